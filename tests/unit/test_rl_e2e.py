"""CPU end-to-end RL with the real components (megatron GPT, LoGRA, KL control, embedded engine).

The tiny recipe is shrunk (2 layers, hidden 64, 20 SFT steps, 4 prompts × 4 samples) so one
build takes seconds after the imports. Expectations are computed here, independently:

* the weight change of every target is rebuilt in float64 from the prepared direction ``D``,
  the projection ``A`` (``SketchSet.projection_for``, a pure function of seed/name/update) and
  the step size α captured at ``optimizer.apply``: ``W_after = W_before − α·D·A``;
* the engine's log-probs after sync are compared against ``log_softmax`` of a fresh megatron
  forward of the trainer model;
* the recorded ``update_ratio`` against ‖ΔW‖/‖W‖ measured from the weight snapshots.

Rewards: the barely warm-started model gets the same (format-penalty) reward on every sample,
so every GRPO group would be uniform and every step skipped. Tests that need a real update
replace the reward with an alternating one (1, 0, 1, 0, ... within each group); the skip test
uses a constant reward on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from support import forked
from support.merge_reference import rademacher_product_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

RECORD_KEYS = {"step", "reward_mean", "accuracy", "eval_accuracy", "response_length", "kl_predicted", "kl_actual",
               "alpha", "budget", "mismatch", "update_ratio", "step_seconds", "rollout_seconds", "sync_bytes"}
FP32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """A shared 2-core machine: intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cfg(run_dir: Path, *extra: str):
    from megatron_logra.config import parse_args_to_config

    return parse_args_to_config("tiny", [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "logra.recipe=paper", "logra.update_ratio=2e-3",
        "sft.steps=20", "sft.init_path=", "tokenizer.path=", "sft.cache=false",
        "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=16",
        "task.num_eval=8", "rl.eval_interval=0", f"train.run_dir={run_dir}", "train.progress=false", *extra,
    ])


def alternating_score():
    """A reward that ignores the text: 1, 0, 1, 0, ... (never a uniform group of even size)."""
    counter = itertools.count()

    def score(problem, completion):
        return (float(next(counter) % 2), False)

    return score


@contextlib.contextmanager
def built_components(run_dir: Path, *extra: str):
    """``(comps, state)`` of ``build_components(small_cfg(run_dir, *extra))`` (warnings silenced); megatron's
    parallel state is torn down on exit."""
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    cfg = small_cfg(run_dir, *extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    try:
        yield comps, state
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with built_components(tmp_path_factory.mktemp("rl_direct") / "run") as out:
        yield out


def fixed_sequence(comps) -> tuple[list[int], int]:
    """A training prompt as the RL loop builds it (``rl_prompt_ids``: BOS, then ``rl.prompt_template`` with
    ``{prompt}`` replaced and every other brace literal) + its reference answer + EOS, and the prompt length."""
    from megatron_logra.rl.loop import rl_prompt_ids

    tok, cfg = comps.tokenizer, comps.cfg
    problem = comps.task.train_problem(12345)
    prompt = rl_prompt_ids(tok, cfg.rl, problem.prompt)
    answer = tok(problem.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return prompt + answer, len(prompt)


class _CodePoints:
    """A tokenizer stand-in: one id per character (its code point), BOS 1, EOS 2."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}


def test_fixed_sequence_templates_the_prompt_as_the_rl_loop_does():
    # a template with literal braces (str.format read \boxed{} as a positional field and raised)
    from types import SimpleNamespace

    from megatron_logra.rl.config import RLConfig

    rl = RLConfig(prompt_template="{prompt}\nPut your final answer within \\boxed{}.")
    problem = SimpleNamespace(prompt="3+4", answer="7")
    comps = SimpleNamespace(tokenizer=_CodePoints(), cfg=SimpleNamespace(rl=rl),
                            task=SimpleNamespace(train_problem=lambda seed: problem))
    seq, plen = fixed_sequence(comps)
    text = "3+4\nPut your final answer within \\boxed{}."
    assert seq == [1] + [ord(ch) for ch in text] + [ord("7"), 2]
    assert plen == 1 + len(text)


def megatron_logprobs(comps, seq: list[int], prompt_len: int) -> torch.Tensor:
    """log_softmax of a fresh trainer forward, at the completion tokens ``seq[prompt_len:]`` (float64)."""
    tokens = torch.tensor([seq])
    pos = torch.arange(len(seq))[None]
    with torch.no_grad():
        logits = comps.model(tokens, pos, None)  # [1, s, V]
    assert logits.dim() == 3 and logits.shape[:2] == (1, len(seq))
    logp = torch.log_softmax(logits[0].double() / comps.cfg.rl.rollout.temperature, dim=-1)
    return torch.stack([logp[t - 1, seq[t]] for t in range(prompt_len, len(seq))])


@pytest.fixture(scope="module")
def stepped(built):
    """One real RL update with everything around it captured."""
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    opt = comps.optimizer
    assert all(not p.requires_grad for p in comps.model.parameters())  # native.freeze=true: all frozen
    target_ids = {id(t.weight) for t in opt.targets}
    before_targets = {t.key: t.weight.detach().clone() for t in opt.targets}
    before_others = {n: p.detach().clone() for n, p in comps.model.named_parameters() if id(p) not in target_ids}
    assert before_others, "the model has non-target parameters (embeddings, norms)"
    seq, plen = fixed_sequence(comps)
    engine_before = torch.tensor(comps.engine.logprobs_of([seq], [plen], comps.cfg.rl.rollout.temperature)[0],
                                 dtype=torch.float64)
    version_before = comps.engine.weight_version
    captured = {}
    real_apply = opt.apply

    def spy(update, alpha=1.0, factors=None):
        captured["update"], captured["alpha"], captured["U"] = update, alpha, factors
        captured["calibration"] = comps.controller.calibration
        captured["D"] = {k: d.detach().clone() for k, d in update.directions.items()}
        captured["A"] = {t.key: opt.sketches.projection_for(t, update.update_index).detach().clone()
                         for t in opt.targets}
        return real_apply(update, alpha, factors=factors)

    opt.apply = spy
    real_score = comps.task.score
    comps.task.score = alternating_score()
    try:
        record = rl_update(comps, state)
    finally:
        del opt.apply
        comps.task.score = real_score
    return dict(record=record, captured=captured, before_targets=before_targets, before_others=before_others,
                seq=seq, plen=plen, engine_before=engine_before, version_before=version_before)


def test_update_is_exactly_minus_U_A_with_U_the_rounded_alpha_D(built, stepped):
    """Sketch-delta sync: the trainer merges U = quantize_factor(α·D) (bf16), the factors it ships."""
    comps, _ = built
    cap = stepped["captured"]
    assert "update" in cap, "optimizer.apply was never called (step skipped?)"
    assert cap["U"] is not None, "sync.mode=delta must hand the optimizer the shipped factors"
    alpha = cap["alpha"]
    assert len(comps.optimizer.targets) == 8  # 4 default targets × 2 layers
    for t in comps.optimizer.targets:
        U, aD = cap["U"][t.key], alpha * cap["D"][t.key].double()
        assert U.dtype == torch.bfloat16 and U.shape == aD.shape
        # U is α·D to bf16 precision (entries far below their row's max may sit on a coarser grid)
        row_max = aD.abs().amax(dim=1, keepdim=True)
        assert ((U.double() - aD).abs() <= 2.0**-8 * aD.abs() + 2.0**-16 * row_max).all(), t.key
        w0 = stepped["before_targets"][t.key]
        A = cap["A"][t.key]
        got = t.weight.detach()
        assert w0.dtype == got.dtype == torch.float32
        # the documented merge: P = grid(s·U)·sign(A), exact; W ⊖ P rounds once
        assert torch.equal(got, w0 - rademacher_product_reference(U, A)), t.key
        # which is -U·A up to fp32 rounding and the grid of s·U (2^(L-24) of each row's max, r terms)
        step = U.double() @ A.double()
        grid = A.shape[0] * 2.0 ** (math.ceil(math.log2(A.shape[0])) - 24) * (U.double() * A.abs().max()).abs().amax(1, keepdim=True)
        err = (got.double() - (w0.double() - step)).abs()
        assert (err <= 2 * FP32_EPS * (w0.double().abs() + step.abs()) + grid).all(), f"{t.key}: {err.max().item():.3e}"
        full = aD @ A.double()
        assert (got.double() - w0.double()).norm().item() == pytest.approx(full.norm().item(), rel=1e-2)


def test_engine_weights_bitwise_equal_to_the_trainer(built, stepped):
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model

    comps, _ = built
    rec = stepped["record"]
    assert rec["sync_mode"] == "delta" and rec["sync_drift"] == 0
    trainer = megatron_to_hf(gather_full_model(comps.model, comps.groups), comps.cfg.model, tp=1)
    engine = dict(comps.engine.model.named_parameters())
    assert set(trainer) == set(engine)
    for name, tensor in trainer.items():
        assert torch.equal(engine[name].detach(), tensor.to(engine[name].dtype)), name
    full_bf16 = sum(t.numel() * 2 for t in trainer.values())
    r = comps.cfg.optimizer.logra.rank
    assert 0 < rec["sync_bytes"] <= (r / comps.cfg.model.hidden_size + 0.02) * full_bf16


def test_non_target_parameters_unchanged(built, stepped):
    comps, _ = built
    params = dict(comps.model.named_parameters())
    for name, before in stepped["before_others"].items():
        assert torch.equal(params[name].detach(), before), name


def test_update_ratio_matches_weights(built, stepped):
    comps, _ = built
    num = sum(((t.weight.detach().double() - stepped["before_targets"][t.key].double()) ** 2).sum()
              for t in comps.optimizer.targets)
    den = sum((stepped["before_targets"][t.key].double() ** 2).sum() for t in comps.optimizer.targets)
    measured = math.sqrt(num / den)
    rec = stepped["record"]
    assert rec["update_ratio"] == pytest.approx(measured, rel=1e-3)
    # paper recipe: ‖D·A‖/‖W‖ = logra.update_ratio before α
    assert measured == pytest.approx(stepped["captured"]["alpha"] * comps.cfg.optimizer.logra.update_ratio, rel=1e-3)


def test_engine_synced_to_new_weights(built, stepped):
    comps, state = built
    assert comps.engine.weight_version == stepped["version_before"] + 1
    assert state.weight_version == comps.engine.weight_version
    seq, plen = stepped["seq"], stepped["plen"]
    after = torch.tensor(comps.engine.logprobs_of([seq], [plen], comps.cfg.rl.rollout.temperature)[0],
                         dtype=torch.float64)
    assert after.shape == stepped["engine_before"].shape and after.numel() >= 2
    assert (after - stepped["engine_before"]).abs().max().item() > 1e-6, "engine log-probs did not change"
    fresh = megatron_logprobs(comps, seq, plen)
    torch.testing.assert_close(after, fresh, rtol=0, atol=1e-4)


def test_record_contents(built, stepped):
    comps, state = built
    rec, cap = stepped["record"], stepped["captured"]
    assert RECORD_KEYS <= set(rec), RECORD_KEYS - set(rec)
    assert rec["step"] == 1 and state.step >= 1 and rec["skipped"] is False
    for key in ("kl_predicted", "kl_actual"):
        assert math.isfinite(rec[key]) and rec[key] > 0, (key, rec[key])
    alpha_max = comps.cfg.kl.alpha_max
    assert 0 < rec["alpha"] <= alpha_max and rec["alpha"] == cap["alpha"]
    # the control law α = min(α_max, sqrt(budget / (c·pred))): either capped or c·α²·pred = budget
    # (kl_predicted = α²·pred, so below the cap c·kl_predicted = budget, at the cap c·kl_predicted <= budget)
    if rec["alpha"] < alpha_max:
        assert cap["calibration"] * rec["kl_predicted"] == pytest.approx(rec["budget"], rel=1e-9)
    else:
        assert cap["calibration"] * rec["kl_predicted"] <= rec["budget"] * (1 + 1e-12)
    # the second-order prediction is close to the measured KL for a step this small
    assert 0.5 < rec["kl_actual"] / rec["kl_predicted"] < 2.0
    # engine and trainer hold the same fp32 weights: rollout and trainer log-probs agree
    assert abs(rec["mismatch"]) < 1e-4
    assert 0 < rec["budget"] <= comps.cfg.kl.budget_start
    assert 0 <= rec["reward_mean"] <= 1 and 0 <= rec["accuracy"] <= 1
    assert rec["reward_mean"] == pytest.approx(0.5)  # alternating 1, 0 over 16 samples
    assert rec["response_length"] >= 1 and rec["sync_bytes"] > 0
    assert rec["step_seconds"] >= rec["rollout_seconds"] > 0
    assert math.isfinite(rec["mismatch"])
    # throughput: every completion token is trained once; rates are over the rollout / the rest of the step
    num = comps.cfg.rl.prompts_per_step * comps.cfg.rl.group_size
    generated = rec["response_length"] * num
    assert rec["train_tokens"] == round(generated)
    assert rec["rollout_tokens_per_second"] == pytest.approx(generated / rec["rollout_seconds"])
    assert rec["train_tokens_per_second"] == pytest.approx(
        rec["train_tokens"] / (rec["step_seconds"] - rec["rollout_seconds"]))
    assert rec["gpu_memory_peak_bytes"] is None and rec["gpu_memory_reserved_peak_bytes"] is None  # CPU
    json.dumps(rec)  # serialisable as a metrics line


def test_zero_advantages_skip_the_step(built, stepped):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
    version, step = comps.engine.weight_version, state.step
    real_score = comps.task.score
    comps.task.score = lambda problem, completion: (0.0, False)
    try:
        rec = rl_update(comps, state)
    finally:
        comps.task.score = real_score
    assert rec["skipped"] is True
    assert rec["step"] == step + 1 and rec["reward_mean"] == 0.0 and rec["accuracy"] == 0.0
    for n, p in comps.model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
    assert comps.engine.weight_version == version and state.weight_version == version
    for k, v in rec.items():
        if isinstance(v, float):
            assert not math.isnan(v), k
    assert RECORD_KEYS <= set(rec), RECORD_KEYS - set(rec)


def test_a_skipped_step_does_not_age_the_kl_budget(built, stepped):
    """The budget is a cosine over *updates* (DESIGN: b0 at the first update, bf after kl.horizon
    updates): an RL step skipped for all-zero advantages must not move the next update along it."""
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    kl = comps.cfg.kl
    applied_before = comps.controller.num_updates
    real_score = comps.task.score
    try:
        comps.task.score = lambda problem, completion: (1.0, True)
        assert rl_update(comps, state)["skipped"] is True
        comps.task.score = alternating_score()
        rec = rl_update(comps, state)
    finally:
        comps.task.score = real_score
    assert rec["skipped"] is False and rec["step"] > applied_before + 1  # the RL step count ran ahead
    n = applied_before + 1  # this is the n-th applied update
    progress = min(n - 1, kl.horizon) / kl.horizon
    b = kl.budget_end + 0.5 * (kl.budget_start - kl.budget_end) * (1 + math.cos(math.pi * progress))
    assert rec["budget"] == pytest.approx(max(b - rec["mismatch"], 0.5 * b), rel=1e-12, abs=0)
    assert comps.controller.num_updates == n


def test_zero_advantages_with_a_kl_penalty_still_update(built, stepped):
    """With ``rl.loss.kl_coef > 0`` the loss is not zero when every advantage is: the penalty still
    pulls the policy towards the reference, so the step is taken."""
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    saved_loss, saved_ref, real_score = comps.cfg.rl.loss, comps.ref_model, comps.task.score
    comps.cfg.rl.loss = dataclasses.replace(saved_loss, kl_coef=0.05)
    comps.ref_model = comps.model  # log-probs taken before the step: the k-estimators' gradients still apply
    comps.task.score = lambda problem, completion: (1.0, True)
    try:
        rec = rl_update(comps, state)
    finally:
        comps.cfg.rl.loss, comps.ref_model, comps.task.score = saved_loss, saved_ref, real_score
    assert rec["reward_mean"] == 1.0 and rec["skipped"] is False
    assert comps.engine.weight_version == state.weight_version


def test_a_non_finite_forward_skips_the_step_instead_of_stopping_the_run(built, stepped):
    """An overflow in the trainer's logits (here +inf at one position of the first sequence) makes the
    sketch non-finite: the optimizer skips the step, nothing is written, and the mismatch estimate
    is not fed a non-finite gap (which would raise)."""
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
    version, mismatch, applied = comps.engine.weight_version, comps.controller.mismatch, comps.controller.num_updates

    def overflow(module, args, out):
        if module.training:
            out = out.clone()
            out.view(-1, out.shape[-1])[0, 0] = float("inf")
        return out

    hook = comps.model.register_forward_hook(overflow)
    real_score = comps.task.score
    comps.task.score = alternating_score()
    try:
        rec = rl_update(comps, state)
    finally:
        hook.remove()
        comps.task.score = real_score
    assert rec["skipped"] is True
    for n, p in comps.model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
    assert comps.engine.weight_version == version and state.weight_version == version
    assert comps.controller.mismatch == mismatch and comps.controller.num_updates == applied


def _assert_engine_equals_trainer(comps):
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model

    trainer = megatron_to_hf(gather_full_model(comps.model, comps.groups), comps.cfg.model, tp=1)
    engine = dict(comps.engine.model.named_parameters())
    for name, tensor in trainer.items():
        assert torch.equal(engine[name].detach(), tensor.to(engine[name].dtype)), name


def test_drift_is_detected_and_repaired_by_a_full_refit(built, stepped):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    with torch.no_grad():  # simulate silent engine-side corruption of one weight row
        comps.engine.model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    real_score = comps.task.score
    comps.task.score = alternating_score()
    try:
        rec = rl_update(comps, state)
    finally:
        comps.task.score = real_score
    assert rec["skipped"] is False
    assert rec["sync_drift"] == 1 and rec["sync_mode"] == "delta+anchor"
    _assert_engine_equals_trainer(comps)
    assert comps.engine.weight_version == state.weight_version


def test_directory_transport_applies_deltas_from_files(built, stepped, tmp_path):
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.sync.config import SyncConfig

    comps, state = built
    real_sync = comps.sync
    comps.sync = PolicySync(SyncConfig(transport="directory", directory=str(tmp_path / "deltas")), model=comps.model,
                            model_cfg=comps.cfg.model, optimizer=comps.optimizer, engine=comps.engine,
                            groups=comps.groups, run_dir=tmp_path)
    real_score = comps.task.score
    comps.task.score = alternating_score()
    try:
        rec = rl_update(comps, state)
    finally:
        comps.task.score = real_score
        comps.sync = real_sync
    assert rec["sync_mode"] == "delta" and rec["sync_drift"] == 0
    files = sorted((tmp_path / "deltas").rglob("delta_*.safetensors"))
    assert [f.name for f in files] == [f"delta_{state.weight_version:08d}.safetensors"]
    assert files[0].stat().st_size == rec["sync_bytes"]
    _assert_engine_equals_trainer(comps)


def test_finite_difference_probe_controls_the_step(built, stepped, monkeypatch):
    """``kl.probe=finite_difference`` (what TE models take): the loop predicts the KL without forward-mode
    AD, and the step it chooses has the measured KL it predicted."""
    from megatron_logra.rl import loop

    comps, state = built

    def no_jvp(*args, **kwargs):
        raise AssertionError("kl.probe=finite_difference must not run the forward-mode probe")

    monkeypatch.setattr(loop, "predicted_kl", no_jvp)
    monkeypatch.setattr(comps.cfg.kl, "probe", "finite_difference")
    real_score = comps.task.score
    comps.task.score = alternating_score()
    try:
        rec = loop.rl_update(comps, state)
    finally:
        comps.task.score = real_score
    assert rec["skipped"] is False and rec["kl_predicted"] > 0
    assert 0.8 < rec["kl_actual"] / rec["kl_predicted"] < 1.25, (rec["kl_actual"], rec["kl_predicted"])
    _assert_engine_equals_trainer(comps)


def test_reference_logprobs_run_per_micro_batch_and_equal_the_whole_batch(built):
    """The KL penalty's reference forward goes one training micro-batch at a time (the whole
    step's logits at once do not fit at scale); the log-probs equal a whole-batch forward."""
    from megatron_logra.rl.batching import pack_sequences
    from megatron_logra.rl.loop import _reference_logprobs

    comps, _ = built
    seq, plen = fixed_sequence(comps)
    prompts = [seq[:plen]] * 5
    completions = [seq[plen:plen + k] for k in (1, 3, 2, len(seq) - plen, 4)]
    batch = pack_sequences(prompts, completions, rollout_logprobs=[[0.0] * len(c) for c in completions],
                           advantages=[0.0] * 5, finished=[True] * 5, pad_id=comps.tokenizer.pad_token_id,
                           max_length=comps.cfg.model.seq_length)
    calls = []
    handle = comps.model.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    saved_ref, saved_mbs = comps.ref_model, comps.cfg.rl.micro_batch_size
    comps.ref_model, comps.cfg.rl.micro_batch_size = comps.model, 2
    try:
        got = _reference_logprobs(comps, batch)
    finally:
        comps.ref_model, comps.cfg.rl.micro_batch_size = saved_ref, saved_mbs
        handle.remove()
    assert calls == [2, 2, 1]
    with torch.no_grad():
        logits = comps.model(batch.tokens, batch.position_ids, None).double()
    want = torch.log_softmax(logits / comps.cfg.rl.rollout.temperature, -1).gather(-1, batch.labels[..., None])[..., 0]
    mask = batch.loss_mask.bool()
    assert got.shape == batch.tokens.shape and mask.sum() == sum(len(c) for c in completions)
    assert torch.allclose(got[mask].double(), want[mask], atol=1e-5)


def test_prompt_longer_than_the_context_is_a_clear_error(built):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    step = state.step
    real = comps.task.train_problem
    long_problem = dataclasses.replace(real(0), prompt="1 + 2 + " * 40 + "3 =")
    comps.task.train_problem = lambda index: long_problem
    try:
        with pytest.raises(ValueError, match="model.seq_length"):
            rl_update(comps, state)
    finally:
        comps.task.train_problem = real
    assert state.step == step


# --------------------------------------------------------------------------- run_rl + cli


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _python(target: list[str]):
    """``python TARGET...`` in a process of its own: forked warm where it can be (:mod:`support.forked`: no
    cold interpreter's imports), else started cold; stdout and stderr captured as text either way."""
    if forked.usable():
        return forked.Python(target, env=_env())
    return subprocess.Popen([sys.executable, *target], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())


def _cli(*commands: list[str], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Run ``python -m megatron_logra.cli ARGS`` for each command, each its own process, concurrently."""
    procs = [_python(["-m", "megatron_logra.cli", *args]) for args in commands]
    out = []
    try:
        for args, proc in zip(commands, procs):
            stdout, stderr = proc.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rewards.task import Task
    from megatron_logra.rl.job import run_rl

    run = tmp_path_factory.mktemp("rl_job") / "run"
    cfg = small_cfg(run)
    counter = itertools.count()
    real = Task.score

    def score(self, problem, completion):  # the task's own reward plus an alternating bonus
        reward, correct = real(self, problem, completion)
        return reward + 0.5 * (next(counter) % 2), correct

    destroy_parallel()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.setattr(Task, "score", score)
        try:
            summary = run_rl(cfg)
        finally:
            destroy_parallel()
    assert summary["steps"] == 2
    return run


def test_run_rl_writes_the_run_directory(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in lines] == [1, 2]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    for r in lines:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert r["skipped"] is False and r["kl_predicted"] > 0 and 0 < r["alpha"] <= cfg["kl"]["alpha_max"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 <= summary["eval_accuracy_before"] <= 1
    assert cfg["rl"]["steps"] == 2 and cfg["model"]["num_layers"] == 2
    tb = run_dir / "tensorboard"
    assert tb.is_dir() and any(p.name.startswith("events.") for p in tb.iterdir())
    tok = run_dir / "tokenizer"
    assert tok.is_dir() and any(tok.iterdir())
    from megatron_logra.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.parent == run_dir / "checkpoints" and (ckpt / "meta.json").exists()
    assert any(p.suffix == ".safetensors" for p in ckpt.iterdir())


def test_cli_eval_and_plot(run_dir):
    ev, pl = _cli(["eval", str(run_dir)], ["plot", str(run_dir)])
    assert ev.returncode == 0, ev.stderr[-3000:]
    out = json.loads(ev.stdout)
    assert 0.0 <= out["eval_accuracy"] <= 1.0 and out["step"] == 2 and out["num_eval"] == 8
    assert pl.returncode == 0, pl.stderr[-3000:]
    png = run_dir / "summary.png"
    assert png.exists() and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_HOLD_RUN_DIR = """
import sys, time
from megatron_logra.checkpoint.run_dir import lock_run_dir
assert lock_run_dir(sys.argv[1]) is None
print("locked", flush=True)
time.sleep(300)
"""


def test_cli_eval_reads_a_run_that_a_job_is_training(run_dir):
    """``megatron-logra eval`` only reads: it evaluates a run whose directory a training job holds (its lock),
    where a second training job is refused."""
    holder = _python(["-c", _HOLD_RUN_DIR, str(run_dir)])
    try:
        if isinstance(holder, forked.Python):
            deadline = time.monotonic() + 120
            while not holder.stdout_so_far() and holder.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert holder.stdout_so_far().strip() == "locked", holder.poll()
        else:
            assert holder.stdout.readline().strip() == "locked"
        ev, resume = _cli(["eval", str(run_dir)], ["train", "--resume", str(run_dir), "rl.steps=3"])
    finally:
        holder.kill()
        holder.wait(timeout=30)
        if isinstance(holder, forked.Python):
            holder.communicate(0)  # removes its output files
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout)["step"] == 2
    assert resume.returncode == 2 and "in use by another running job" in resume.stderr


def test_resume_below_the_checkpoint_step_is_refused_and_nothing_changes(run_dir, capsys):
    """``--resume RUN rl.steps=1`` on a run checkpointed at step 2: refused naming rl.steps (exit 2,
    no traceback) before config.yaml, the tokenizer, metrics or checkpoints change."""
    from megatron_logra.cli import main
    from megatron_logra.parallel import destroy_parallel

    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    try:
        with pytest.raises(SystemExit) as exc:
            main(["train", "--resume", str(run_dir), "rl.steps=1"])
    finally:
        destroy_parallel()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "rl.steps=1" in err and "(step 2)" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_cli_eval_without_checkpoint_fails(run_dir, tmp_path):
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    no_ckpt, no_run = _cli(["eval", str(empty)], ["eval", str(tmp_path / "missing")], timeout=120)
    assert no_ckpt.returncode != 0
    assert "no checkpoint" in no_ckpt.stderr and str(empty) in no_ckpt.stderr
    # not a run directory at all
    assert no_run.returncode != 0 and "config.yaml" in no_run.stderr


def test_resuming_a_finished_run_trains_and_saves_nothing(run_dir, tmp_path, caplog):
    import logging
    import shutil

    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    before = {p: p.stat().st_mtime_ns for c in ckpts for p in c.rglob("*")}
    metrics = (run / "metrics.jsonl").read_text()
    destroy_parallel()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="megatron_logra.rl.job"):
        warnings.simplefilter("ignore")
        try:
            summary = run_rl(small_cfg(run, "train.resume=true"))
        finally:
            destroy_parallel()
    assert summary["steps"] == 2
    assert "nothing to train" in caplog.text
    assert sorted((run / "checkpoints").glob("step_*")) == ckpts
    assert {p: p.stat().st_mtime_ns for c in ckpts for p in c.rglob("*")} == before
    assert (run / "metrics.jsonl").read_text() == metrics


def test_train_starts_from_a_hugging_face_checkpoint(tmp_path):
    """``--model.hf_path``: architecture, weights and tokenizer come from a local HF checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_logra.config import WARM_START_TINY
    from megatron_logra.data.tokenizer import load_tokenizer

    hf_dir = tmp_path / "hf"
    tok = load_tokenizer(WARM_START_TINY / "tokenizer")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, rms_norm_eps=1e-6))
    hf.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    run = tmp_path / "run"
    (proc,) = _cli(["train", "tiny", f"--model.hf_path={hf_dir}", "rl.steps=1", "rl.prompts_per_step=4",
                    "rl.group_size=2", "task.num_eval=4", "rl.eval_interval=0", f"train.run_dir={run}",
                    "train.progress=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["hidden_size"] == 48 and cfg["model"]["num_query_groups"] == 2
    assert cfg["model"]["num_layers"] == 2 and cfg["model"]["hf_path"] == str(hf_dir)
    assert "started from" in proc.stderr
    (bad,) = _cli(["train", "tiny", f"--model.hf_path={tmp_path / 'missing'}", f"train.run_dir={run}2"])
    assert bad.returncode != 0 and "model.hf_path" in bad.stderr

