"""``LograOptimizer.apply`` writes nothing unless the whole step is finite.

A non-finite direction (or sync factor), or a step size that overflows ``α·D``, raises ``ValueError``
before any write: target weights, fp32 masters, native parameters and AdamW state, row moments and the
projection index are compared bitwise before and after. The verdict is agreed over the model-parallel
group (a flag raised on another rank refuses the step here too).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
from megatron_logra.parallel import ParallelGroups

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _prepared(dtype: torch.dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=4, targets=["0", "2"], lr=1e-2),
                                                     native=NativeConfig(lr=1e-2)), ParallelGroups())
    x = torch.randn(16, 8, dtype=dtype)
    opt.zero_grad()
    model(x).float().pow(2).sum().backward()
    update = opt.prepare(num_tokens=16)
    assert not update.skipped and opt.native.params  # native params are trained: their state must stay put
    return model, opt, update


def _snapshot(model, opt) -> dict:
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"master/{k}": m.clone() for k, m in opt.masters.items()})
    out.update({f"row_moment/{k}": v.clone() for k, v in opt.row_moments.items()})
    out["native_state"] = len(opt.native.inner.state)
    out["counters"] = (opt.num_steps, opt.sketches.update)
    return out


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, after[k]), k
        else:
            assert v == after[k], k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", ["nan", "inf", "overflowing-alpha"])
def test_nonfinite_direction_writes_nothing(dtype, bad):
    model, opt, update = _prepared(dtype)
    key = opt.targets[-1].key  # the last target: the first would be written before a late check
    alpha = 1.0
    if bad == "overflowing-alpha":
        alpha = 1e39 / float(update.directions[key].abs().max())  # α·D overflows fp32
    else:
        update.directions[key][0, 1] = float(bad)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"not finite.*nothing was modified") as err:
        opt.apply(update, alpha)
    assert key in str(err.value)  # names the target
    _assert_unchanged(before, _snapshot(model, opt))


def test_nonfinite_sync_factor_writes_nothing():
    model, opt, update = _prepared(torch.bfloat16)
    factors = {k: d.to(torch.bfloat16) for k, d in update.directions.items()}
    factors[opt.targets[-1].key][1, 0] = float("nan")
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="not finite"):
        opt.apply(update, 1.0, factors=factors)
    _assert_unchanged(before, _snapshot(model, opt))


def test_a_flag_from_another_model_parallel_rank_refuses_the_step(monkeypatch):
    """Every rank raises when any rank saw a non-finite step (one collective, as prepare's skip)."""
    import megatron_logra.optim.logra_apply as logra_apply

    model, opt, update = _prepared(torch.float32)
    seen = []

    def other_rank_saw_nan(flag, group, device):
        seen.append(flag)
        return True

    monkeypatch.setattr(logra_apply, "reduce_flag_any", other_rank_saw_nan)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="another model-parallel rank"):
        opt.apply(update, 1.0)
    assert seen == [False]  # this rank's own step was finite
    _assert_unchanged(before, _snapshot(model, opt))


def test_finite_step_still_applies():
    model, opt, update = _prepared(torch.float32)
    before = _snapshot(model, opt)
    opt.apply(update, 0.5)
    after = _snapshot(model, opt)
    assert after["counters"] == (1, before["counters"][1] + 1)
    assert all(not torch.equal(before[k], after[k]) for k in before if k.startswith("param/"))
