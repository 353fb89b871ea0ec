"""Sketch-delta sync of a bf16 model: the embedded engine mirrors the trainer bit for bit.

A bf16 trainer keeps megatron's norms in fp32; the engine runs in the trainer's compute dtype
(``model.params_dtype``, as SGLang does) and holds them rounded. The drift check must compare
exactly that, so clean updates stay ``delta`` with no drift (a false alarm would force a full
refit every step), while a real divergence is still caught.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from test_rl_e2e import alternating_score, small_cfg


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import rl_update

    torch.set_num_threads(1)
    cfg = small_cfg(tmp_path_factory.mktemp("rl_bf16") / "run", "model.params_dtype=bfloat16", "sft.steps=4",
                    "sync.check_interval=1", "sync.anchor_interval=0",
                    "sync.max_master_drift=0",  # no master re-anchor: any full refit here would be a false alarm
                    "model.make_vocab_size_divisible_by=64")  # 160 ids padded to 192
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    comps.task.score = alternating_score()
    records = [rl_update(comps, state) for _ in range(2)]
    yield comps, records
    destroy_parallel()


def test_bf16_engine_runs_in_the_trainer_compute_dtype(bf16_run):
    comps, _ = bf16_run
    dtypes = {p.dtype for p in comps.engine.model.parameters()}
    assert dtypes == {torch.bfloat16}
    norms = [p for n, p in comps.model.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 for p in norms)  # the case the cast exists for


def test_bf16_updates_sync_as_deltas_without_drift(bf16_run):
    comps, records = bf16_run
    for r in records:
        assert (r["sync_mode"], r["sync_drift"]) == ("delta", 0), r
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model

    trainer = megatron_to_hf(gather_full_model(comps.model, comps.groups), comps.cfg.model, tp=1)
    engine = dict(comps.engine.model.named_parameters())
    assert set(trainer) == set(engine)
    for name, tensor in trainer.items():
        assert torch.equal(engine[name].detach(), tensor.to(torch.bfloat16)), name


def test_bf16_drift_check_catches_one_changed_engine_row(bf16_run):
    from megatron_logra.rl.weights import trainer_fingerprint
    from megatron_logra.sync import drift
    from megatron_logra.sync.fingerprint import fingerprint_salt

    comps, _ = bf16_run
    engine_fp = comps.engine.fingerprint()
    salt = fingerprint_salt(engine_fp)
    assert salt == comps.engine.weight_version  # the engine samples the rows of its version
    trainer_fp = trainer_fingerprint(comps.model, comps.groups, comps.cfg.model, dtype=torch.bfloat16, salt=salt,
                                     vocab_rows=comps.engine.fingerprint_vocab_rows)  # as policy sync asks
    assert drift(engine_fp, trainer_fp) == []
    w = dict(comps.engine.model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    saved = w.detach().clone()
    with torch.no_grad():
        w[-1, 0] = w[-1, 0] * 2 + 1  # the last row is always sampled
    try:
        assert drift(comps.engine.fingerprint(), trainer_fp) == ["model.layers.1.mlp.down_proj.weight"]
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_drift_check_of_an_engine_that_serves_only_the_unpadded_vocabulary(bf16_run):
    """SGLang started from the Hugging Face checkpoint holds ``vocab_size`` rows of ``embed_tokens``
    and ``lm_head``, the trainer its padded vocabulary: ``vocab_rows`` fingerprints the rows both
    hold, so a clean engine matches and a changed served row is still caught."""
    from megatron_logra.rl.weights import trainer_fingerprint
    from megatron_logra.sync import drift, fingerprint
    from megatron_logra.sync.layout import VOCAB_PARALLEL

    comps, _ = bf16_run
    vocab, padded = comps.cfg.model.vocab_size, comps.cfg.model.padded_vocab_size(1)
    assert vocab < padded
    engine = {n: p.detach().clone() for n, p in comps.engine.model.named_parameters()}
    vocab_names = sorted(n for n in engine if n in VOCAB_PARALLEL)
    assert vocab_names and all(engine[n].shape[0] == padded for n in vocab_names)
    served = {n: (w[:vocab].clone() if n in VOCAB_PARALLEL else w) for n, w in engine.items()}

    trainer_fp = trainer_fingerprint(comps.model, comps.groups, comps.cfg.model, dtype=torch.bfloat16,
                                     vocab_rows=vocab)
    assert drift(fingerprint(served), trainer_fp) == []
    padded_fp = trainer_fingerprint(comps.model, comps.groups, comps.cfg.model, dtype=torch.bfloat16)
    assert drift(fingerprint(served), padded_fp) == vocab_names  # what the check compared before
    served["model.embed_tokens.weight"][vocab - 1, 3] += 1  # the last served row is always sampled
    assert drift(fingerprint(served), trainer_fp) == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="engine serves"):
        trainer_fingerprint(comps.model, comps.groups, comps.cfg.model, vocab_rows=padded + 1)
