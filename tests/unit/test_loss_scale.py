"""Loss scaling of float16 models (``optimizer.loss_scale``, Megatron-LM's ``--fp16``).

* The scaler's rules are megatron-core's ``DynamicGradScaler.update`` (run here on CPU tensors, unbound) and,
  with ``hysteresis=1``, torch's own ``_amp_update_scale_`` (``torch.amp.GradScaler``'s kernel).
* On a float16 megatron-core GPT whose loss is so small that its activation gradients underflow float16,
  the unscaled sketches and gradients the optimizer reads with a loss scale match those of a float32 copy of
  the model, and without one they are lost (the reference is the float32 model, no scaling).
* An overflow skips the step without touching a weight, lowers the scale, and is not a bad step of the RL loop
  (``rl.max_bad_steps=1`` would stop the run on the first one); at the minimum scale it is.
* The scale survives a checkpoint; the Megatron-LM flags map to the fields.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from megatron_logra.config import parse_args_to_config
from megatron_logra.optim import LograConfig, LossScaleConfig, NativeConfig, OptimizerConfig, build_optimizer
from megatron_logra.optim.loss_scale import LossScaler
from megatron_logra.train.step import Batch, forward_backward
from support.run_fixtures import run_recipe

B, S, V = 2, 12, 48
TINY = 1e-9
"""Loss factor: float16's smallest subnormal is about 6e-8, so ``TINY × (softmax − onehot)`` underflows."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: single-threaded (conftest.one_thread)."""


# --------------------------------------------------------------------------- the scaler's rules

def _megatron_scaler(initial: float, min_scale: float, window: int, hysteresis: int):
    """megatron-core's DynamicGradScaler with its state on the CPU (its constructor puts it on CUDA)."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    ref = object.__new__(DynamicGradScaler)
    ref._scale = torch.tensor([initial], dtype=torch.float)
    ref.min_scale = torch.tensor([min_scale], dtype=torch.float)
    ref.growth_factor = torch.tensor([2.0])
    ref.backoff_factor = torch.tensor([0.5])
    ref.growth_interval, ref.hysteresis = window, hysteresis
    ref._growth_tracker, ref._hysteresis_tracker = 0, hysteresis
    return ref


@pytest.mark.parametrize("hysteresis, window, p_inf", [(1, 3, 0.3), (2, 4, 0.4), (3, 2, 0.5), (2, 1000, 0.05)])
def test_scale_follows_megatron_cores_dynamic_grad_scaler(hysteresis, window, p_inf):
    rng = random.Random(hysteresis * 100 + window)
    ours = LossScaler(LossScaleConfig(mode="dynamic", initial=2.0**16, min_scale=4.0, window=window,
                                      hysteresis=hysteresis))
    ref = _megatron_scaler(2.0**16, 4.0, window, hysteresis)
    for _ in range(3000):
        found_inf = rng.random() < p_inf
        ours.update(found_inf)
        ref.update(found_inf)
        assert ours.scale == ref._scale.item()
        assert (ours.growth_tracker, ours.hysteresis_tracker) == (ref._growth_tracker, ref._hysteresis_tracker)


def test_without_hysteresis_the_scale_follows_torchs_grad_scaler_kernel():
    rng = random.Random(7)
    ours = LossScaler(LossScaleConfig(mode="dynamic", initial=2.0**10, min_scale=2.0**-60, window=5, hysteresis=1))
    scale, growth = torch.tensor([2.0**10]), torch.tensor([0], dtype=torch.int32)
    for _ in range(2000):  # (torch's kernel has no minimum: the walk stays far above ours)
        found_inf = rng.random() < 0.1
        ours.update(found_inf)
        torch._amp_update_scale_(scale, growth, torch.tensor([float(found_inf)]), 2.0, 0.5, 5)
        assert ours.scale == scale.item()


def test_static_scale_never_changes_and_is_always_at_its_minimum():
    scaler = LossScaler(LossScaleConfig(mode="static", initial=512.0, min_scale=1.0))
    for found_inf in (True, True, False, True):
        scaler.update(found_inf)
    assert scaler.scale == 512.0 and scaler.at_minimum


@pytest.mark.parametrize("kw, field", [({"mode": "fp16"}, "mode"), ({"initial": 0.0}, "initial"),
                                       ({"initial": float("inf")}, "initial"), ({"min_scale": -1.0}, "min_scale"),
                                       ({"min_scale": 2.0**20}, "min_scale"), ({"window": 0}, "window"),
                                       ({"hysteresis": True}, "hysteresis")])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"optimizer\.loss_scale\.{field}="):
        LossScaleConfig(**kw)


def test_auto_scales_float16_models_only():
    cfg = LossScaleConfig()
    assert cfg.enabled_for([torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.float16)])
    assert not cfg.enabled_for([torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)])
    assert LossScaleConfig(mode="dynamic").enabled_for([torch.zeros(2)])
    assert not LossScaleConfig(mode="none").enabled_for([torch.zeros(2, dtype=torch.float16)])


# --------------------------------------------------------------------------- a float16 megatron-core GPT

def _gpt(groups, dtype: str):
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                                     seq_length=S, init_std=0.1, vocab_size=V, params_dtype=dtype), groups, seed=3)


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)
    mask = torch.ones(B, S)
    mask[:, :3] = 0.0
    return Batch(tokens, labels, mask, torch.arange(S)[None].expand(B, S).contiguous())


def _tiny_loss(mb: Batch, logits: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, mb.labels[..., None])[..., 0]
    loss = -(logp * mb.loss_mask).sum() * TINY
    return loss, mb.loss_mask.sum().to(torch.int), {"lm": torch.stack([loss.detach(), mb.loss_mask.sum()])}


def _optimizer(model, groups, **scale):
    return build_optimizer(model, OptimizerConfig(
        logra=LograConfig(rank=8, clip_grad=0.0, targets=["linear_qkv", "linear_fc1", "linear_fc2"]),
        native=NativeConfig(lr=1e-4), loss_scale=LossScaleConfig(**scale)), groups)


def _prepared(model, groups, **scale):
    """Build an optimizer on ``model``, run one forward/backward at its loss scale and prepare; returns the
    update, the unscaled sketches and gradients it read, and the optimizer (its hooks removed, so the next one
    can be built on the same model)."""
    opt = _optimizer(model, groups, **scale)
    opt.zero_grad()
    result = forward_backward(model, [_batch()], groups, loss_fn=_tiny_loss, grad_scale=opt.loss_scale)
    update = opt.prepare(num_tokens=result.num_tokens)
    sketches = {t.key: t.sketch.double().clone() for t in opt.targets}
    grads = [g.double().clone() for g in opt.native.grads()]
    opt.sketches.remove()
    opt.native.remove_hooks()
    return update, sketches, grads, opt


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def models(groups):
    """A float16 GPT and its float32 copy (the same weights, upcast)."""
    half = _gpt(groups, "float16")
    full = _gpt(groups, "float32")
    with torch.no_grad():
        for (name, p), (name32, p32) in zip(half.named_parameters(), full.named_parameters()):
            assert name == name32
            p32.copy_(p.float())
    return half, full


def test_scaled_float16_sketches_and_grads_match_the_float32_model(models, groups):
    half, full = models
    ref_update, ref_sketches, ref_grads, _ = _prepared(full, groups)
    assert ref_update.loss_scale is None  # float32: auto does not scale
    update, sketches, grads, _ = _prepared(half, groups, initial=2.0**20)  # TINY × 2**20 ≈ 1e-3
    assert update.loss_scale == 2.0**20 and not update.skipped
    plain_update, plain_sketches, plain_grads, _ = _prepared(half, groups, mode="none")
    assert plain_update.loss_scale is None
    for key, ref in ref_sketches.items():
        assert ref.norm() > 0
        assert _rel(sketches[key], ref) < 0.02, key  # float16 forward: ~1e-3 relative differences
        assert _rel(plain_sketches[key], ref) > 0.5, key  # underflowed to (mostly) zero
    lost = 0
    for ref, g, plain in zip(ref_grads, grads, plain_grads):
        if ref.norm() > 0:
            assert _rel(g, ref) < 0.02
            lost += _rel(plain, ref) > 0.5
    assert lost > 0


def test_an_overflow_skips_the_step_untouched_and_lowers_the_scale(models, groups):
    half, _ = models
    before = {n: p.detach().clone() for n, p in half.named_parameters()}
    update, _, _, opt = _prepared(half, groups, initial=2.0**60, hysteresis=1)
    assert update.skipped and update.overflow and update.loss_scale == 2.0**60
    assert f"float16 overflow at loss scale {2.0**60:g}" in update.reason and opt.loss_scale == 2.0**59
    opt.apply(update, 1.0)
    assert all(torch.equal(p, before[n]) for n, p in half.named_parameters())
    saved = json.loads(json.dumps(opt.sharded_state()[0]))  # checkpoint scalars are JSON
    assert saved["loss_scale"]["scale"] == 2.0**59

    # at the minimum scale an overflow is a non-finite gradient like any other
    update, _, _, stuck = _prepared(half, groups, initial=2.0**60, min_scale=2.0**60, hysteresis=1)
    assert update.skipped and not update.overflow
    assert "at the minimum loss scale" in update.reason and stuck.loss_scale == 2.0**60

    # a checkpoint's scale is where the resumed run continues
    _, _, _, restored = _prepared(half, groups, initial=2.0**20, hysteresis=1)
    restored.load_sharded_state(saved, restored.sharded_state()[1])
    assert restored.loss_scale == 2.0**59 and restored.scaler.growth_tracker == 0
    unscaled = _optimizer(half, groups, mode="none")
    unscaled.load_sharded_state(saved, unscaled.sharded_state()[1])  # a saved scale does not turn scaling on
    assert unscaled.loss_scale == 1.0 and unscaled.scaler is None
    unscaled.sketches.remove()
    unscaled.native.remove_hooks()


def test_the_rl_loop_reruns_an_overflowing_backward_on_the_same_rollouts(tmp_path):
    """Rollouts are not wasted on an overflow: the step's forward/backward runs again at the lowered scale
    (``rl.max_bad_steps=1`` would stop the run at the first skipped step), and the applied step records the
    scale it ran at and how many re-runs it took."""
    run = tmp_path / "run"
    summary = run_recipe("tiny", [f"train.run_dir={run}", "--fp16", "rl.steps=3", "rl.max_bad_steps=1",
                                  f"optimizer.loss_scale.initial={2.0**40}", "optimizer.loss_scale.hysteresis=1",
                                  "rl.eval_interval=0", "task.num_eval=0", "train.progress=false",
                                  "rl.prompts_per_step=4", "rl.group_size=4", "model.seq_length=96"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "loss_scale" in r]
    assert len(steps) == 3 and not any(r["skipped"] for r in steps)
    first = steps[0]
    assert first["overflow_retries"] >= 1 and first["loss_scale"] == 2.0**40 / 2.0**first["overflow_retries"]
    scale = first["loss_scale"]
    for r in steps[1:]:  # each later step starts where the last one ended
        assert r["loss_scale"] == scale / 2.0**r["overflow_retries"]
        scale = r["loss_scale"]
    assert summary["steps"] == 3


def _lm_records(run) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "step" in r and "loss" in r]


def test_a_resumed_float16_run_continues_at_the_checkpointed_scale(tmp_path):
    """The LM job skips an overflowing step (as Megatron-LM); the scale it came down to is checkpointed, so a run
    resumed after step 3 runs steps 4..6 exactly as the uninterrupted run (a fresh scaler would start over at
    ``initial`` and overflow again)."""
    common = ["--fp16", f"optimizer.loss_scale.initial={2.0**17}", "optimizer.loss_scale.hysteresis=1",
              "train.eval_interval=0", "train.progress=false", "train.eval_sequences=16"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_recipe("lm-tiny", [*common, f"train.run_dir={whole}", "train.steps=6"])
    run_recipe("lm-tiny", [*common, f"train.run_dir={split}", "train.steps=3", "train.save_interval=3"])
    run_recipe("lm-tiny", [*common, f"train.run_dir={split}", "train.steps=6", "train.resume=true"])
    expected = _lm_records(whole)
    assert expected[0]["skipped"] and expected[0]["loss_scale"] == 2.0**17  # 2**17 overflows float16 at once
    assert "float16 overflow at loss scale 131072" in expected[0]["skip_reason"]
    assert all("skip_reason" not in r for r in expected if not r["skipped"])
    assert expected[3]["loss_scale"] < 2.0**17
    resumed = [r for r in _lm_records(split) if r["step"] > 3][-3:]
    keys = ("step", "loss", "loss_scale", "skipped")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in expected[3:]]


# --------------------------------------------------------------------------- flags

def test_megatron_flags_set_the_fields():
    cfg = parse_args_to_config("lm-tiny", ["--fp16", "--initial-loss-scale", "4096", "--min-loss-scale", "2",
                                           "--loss-scale-window", "50", "--hysteresis", "3"])
    assert (cfg.optimizer.loss_scale.mode, cfg.optimizer.loss_scale.initial, cfg.optimizer.loss_scale.min_scale,
            cfg.optimizer.loss_scale.window, cfg.optimizer.loss_scale.hysteresis) == ("auto", 4096.0, 2.0, 50, 3)
    static = parse_args_to_config("lm-tiny", ["--fp16", "--loss-scale", "1024"])
    assert (static.optimizer.loss_scale.mode, static.optimizer.loss_scale.initial) == ("static", 1024.0)
    with pytest.raises(ValueError, match="set twice"):
        parse_args_to_config("lm-tiny", ["--loss-scale", "1024", "--initial-loss-scale", "512"])
