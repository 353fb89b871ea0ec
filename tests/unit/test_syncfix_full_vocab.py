"""``sync.transport=directory`` with a padded vocabulary (``model.vocab_size=160`` padded to 192): the refit's
full-weights file holds the model's 160 vocabulary rows, as its HF checkpoint does, so an engine started from
that checkpoint reloads it and verifies the anchor by fingerprint; the trainer's own engine keeps its padded
rows."""

from __future__ import annotations

import pytest
import torch

from test_rl_e2e import built_components


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    run = tmp_path_factory.mktemp("full_vocab") / "run"
    with built_components(run, "sft.steps=0", "model.params_dtype=bfloat16", "model.make_vocab_size_divisible_by=64",
                          "sync.transport=directory") as (comps, state):
        yield comps, state, run / "deltas" / "rank0"


def test_an_engine_of_the_model_vocabulary_reloads_the_start_refit_and_verifies_its_anchor(built):
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model
    from megatron_logra.sync import DirectoryTransport, ModuleEngine
    from megatron_logra.sync.layout import VOCAB_PARALLEL
    from test_sync_transport import _HFModule

    comps, state, directory = built
    model = comps.cfg.model
    assert (model.vocab_size, model.padded_vocab_size(1)) == (160, 192)
    assert comps.engine.expected_shapes()["model.embed_tokens.weight"] == (192, 64)  # the trainer's own engine
    trainer = megatron_to_hf(gather_full_model(comps.model, comps.groups), model, tp=1)
    real = {n: t[:160] if n in VOCAB_PARALLEL else t for n, t in trainer.items()}
    consumer = DirectoryTransport(directory)
    with consumer.open_full() as reader:
        assert reader.vocab_rows == 160 and reader.version == state.weight_version
        assert {n: s for n, s in reader.shapes().items() if n in VOCAB_PARALLEL} == \
            {n: [160, 64] for n in VOCAB_PARALLEL if n in real}
    # an engine started from the model's HF checkpoint (vocab_size 160), at other weights
    engine = ModuleEngine(_HFModule({n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in real.items()}))
    assert consumer.load_full(engine)["version"] == state.weight_version
    weights = engine.weights()
    for name, tensor in real.items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name
    DirectoryTransport(directory).verify_anchor(engine)  # a restarted consumer: by fingerprint, same rows


def test_an_embedded_engine_reloads_the_model_vocabulary_into_its_padded_rows_and_verifies_the_anchor(built):
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model
    from megatron_logra.rollout.embedded import EmbeddedEngine
    from megatron_logra.sync import DirectoryTransport
    from megatron_logra.sync.layout import VOCAB_PARALLEL

    comps, state, directory = built
    model = comps.cfg.model
    trainer = megatron_to_hf(gather_full_model(comps.model, comps.groups), model, tp=1)
    # padded to 192 rows, other weights; its fingerprint covers the model's rows, as the anchor markers do
    engine = EmbeddedEngine(model, dtype=torch.bfloat16, init_seed=123, vocab_rows=model.vocab_size)
    padding = {n: p.detach()[160:].clone() for n, p in engine.model.named_parameters() if n in VOCAB_PARALLEL}
    consumer = DirectoryTransport(directory)
    assert consumer.load_full(engine)["version"] == state.weight_version == engine.weight_version
    for name, p in engine.model.named_parameters():
        if name in VOCAB_PARALLEL:
            assert torch.equal(p[:160], trainer[name][:160].to(torch.bfloat16)), name
            assert torch.equal(p[160:], padding[name]), name  # the padding rows stay as they were
        else:
            assert torch.equal(p, trainer[name].to(torch.bfloat16)), name
    DirectoryTransport(directory).verify_anchor(engine)  # a restarted consumer: by fingerprint, the model's rows
