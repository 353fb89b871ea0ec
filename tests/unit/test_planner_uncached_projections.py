"""LoGRA without the projection cache: ``prepare()`` still generates and holds every target's fp32
projection, and the plan counts them in the optimizer phase (not from forward to apply)."""

from __future__ import annotations

import torch

from megatron_logra.memory.measure import LiveTensorTracker
from megatron_logra.memory.planner import plan
from megatron_logra.models.gpt import ModelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=64,
                    seq_length=16, params_dtype="bfloat16")
RANK = 16


def _live_at_directions(groups, monkeypatch, cache: bool) -> int:
    """Live tensor bytes above the start of ``prepare()`` (after one forward / backward) when it computes
    the last target's direction (the projections are generated before the directions and kept after)."""
    import megatron_logra.optim.logra as logra_module
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer

    seen = []
    real = logra_module.row_adam_direction

    def spy(*args, **kwargs):
        seen.append(tracker.current - start)
        return real(*args, **kwargs)

    monkeypatch.setattr(logra_module, "row_adam_direction", spy)

    gpt = build_gpt(MODEL, groups, seed=1)
    opt = build_optimizer(gpt, OptimizerConfig(name="logra", native=NativeConfig(lr=1e-3, freeze=True),
                                               logra=LograConfig(rank=RANK, lr=1e-3, cache_projections=cache)), groups)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    gpt(tokens, torch.arange(16)[None], None, labels=tokens).float().sum().backward()
    with LiveTensorTracker() as tracker:
        start = tracker.current
        opt.prepare()
    return max(seen)


def test_prepare_holds_every_projection_without_the_cache_and_the_plan_counts_them(groups, one_thread, monkeypatch):
    on, off = (plan(MODEL, rank=RANK, micro_batch=2, seq_len=16, freeze_native=True, cache_projections=flag).worst
               for flag in (True, False))
    projections = 4 * RANK * on.counts.target_cols
    assert (on.projection_cache, on.projection_working) == (projections, 0)
    assert (off.projection_cache, off.projection_working) == (0, projections)
    # measured: the uncached prepare() holds exactly the projections more than the cached one (whose
    # projections were alive before it started)
    assert _live_at_directions(groups, monkeypatch, False) - _live_at_directions(groups, monkeypatch, True) == projections
    # planned: they sit beside the directions in the optimizer phase, and nowhere else
    directions = off.step_working - off.largest_update
    assert off.optimizer_working >= directions + projections
    assert off.forward_backward == on.forward_backward
    assert off.trainer_peak >= off.persistent + directions + projections
