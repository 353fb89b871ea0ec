"""LoGRA optimizer with bf16 targets (DESIGN §1, "Optimizer (RowAdam)"): fp32 masters, bf16-only steps,
and the merge's rounding (stochastic: unbiased, one of the two bf16 neighbours, fresh noise each step;
nearest: ``to(bfloat16)``). References are computed here: exact bf16 neighbours with Python floats and
``torch.Tensor.to(torch.bfloat16)``; see ``tests/unit/test_optim.py`` for the tolerances' reasoning.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_logra.optim import NativeConfig
from megatron_logra.sync.apply import StochasticRounding, low_rank_merge_
from support.optim_models import single_thread  # noqa: F401  (an autouse fixture)
from support.optim_models import F64, bf16_ulp, make_logra, make_mlp, proj


def _neighbours(x: float) -> tuple[float, float, float]:
    """(lower-magnitude, higher-magnitude) bf16 neighbours of x and the bf16 spacing there."""
    ulp = 2.0 ** (math.floor(math.log2(abs(x))) - 7)
    lo = math.floor(abs(x) / ulp) * ulp
    return math.copysign(lo, x), math.copysign(lo + ulp, x), ulp


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2**-7, -(3.0 + 0.85 * 2**-6), 0.011 + 1.234e-7])
def test_stochastic_merge_rounding_is_unbiased_and_picks_a_neighbour(value):
    """The merge kernel of master-less bf16 weights (what ``LograOptimizer.apply`` runs): ``W = 0 − (−x)·1``
    is ``x`` exactly in fp32, then rounded with the step's noise to one of x's two bf16 neighbours, ``hi``
    with probability ``(x − lo) / ulp``."""
    x = float(torch.tensor(value, dtype=torch.float32))
    lo, hi, ulp = _neighbours(x)
    assert lo != x != hi
    rows, cols = 400, 500
    noise = StochasticRounding(5, "model.layers.0.mlp.down_proj", 3)

    def merged(target: float) -> torch.Tensor:
        w = torch.zeros(rows, cols, dtype=torch.bfloat16)
        low_rank_merge_(w, torch.full((rows, 1), -target), torch.ones(1, cols), distribution="gaussian",
                        rounding=noise)
        return w

    out = merged(x)
    assert set(out.double().unique().tolist()) == {lo, hi}
    n = out.numel()
    p = abs(x - lo) / ulp
    # the mean of n Bernoulli(p) roundings has std ulp·sqrt(p(1-p)/n); allow 6 std (P(false alarm) < 1e-8)
    assert abs(out.double().mean().item() - x) <= 6 * ulp * math.sqrt(p * (1 - p) / n)
    # representable values are never moved, whatever the noise
    assert bool((merged(lo).double() == lo).all())


def test_nearest_rounding_equals_to_bfloat16():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(13))
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    # W = 0 - (-I)·x == x exactly in fp32, then rounded without noise
    low_rank_merge_(w, -torch.eye(64), x, distribution="gaussian")
    assert torch.equal(w, x.to(torch.bfloat16))


def test_bf16_targets_with_fp32_masters():
    model = make_mlp(5, dtype=torch.bfloat16)
    lr = 1e-3
    opt = make_logra(model, algorithm="sgd", lr=lr, masters="fp32", rank=16)
    gen = torch.Generator().manual_seed(14)
    master_ref = {}
    for t in opt.targets:
        assert t.weight.dtype == torch.bfloat16
        m = opt.masters[t.key]
        assert m.dtype == torch.float32 and m.data_ptr() != t.weight.data_ptr()
        assert torch.equal(m, t.weight.float())
        master_ref[t.key] = t.weight.double().clone()
    for step in range(1, 6):
        opt.zero_grad()
        sketches = {}
        for t in opt.targets:  # the sketch buffer is the optimizer's input
            sketches[t.key] = torch.randn(t.weight.shape[0], 16, generator=gen) * 0.1
            t.sketch.copy_(sketches[t.key])
        opt.step()
        for t in opt.targets:
            master_ref[t.key] -= lr * sketches[t.key].double() @ proj(opt, t, step - 1)
            torch.testing.assert_close(opt.masters[t.key].double(), master_ref[t.key], rtol=1e-6, atol=1e-7)
            assert torch.equal(t.weight, opt.masters[t.key].to(torch.bfloat16))
    # the master keeps what bf16 cannot hold
    assert any(not torch.equal(opt.masters[t.key], t.weight.float()) for t in opt.targets)


def test_bf16_only_nearest_rounds_each_update_to_nearest():
    model = make_mlp(6, dtype=torch.bfloat16)
    lr = 3e-2
    opt = make_logra(model, algorithm="sgd", lr=lr, masters="none", rounding="nearest", rank=16)
    assert opt.masters == {}
    w0 = {t.key: t.weight.double().clone() for t in opt.targets}
    gen = torch.Generator().manual_seed(15)
    sketches = {}
    opt.zero_grad()
    for t in opt.targets:
        sketches[t.key] = torch.randn(t.weight.shape[0], 16, generator=gen)
        t.sketch.copy_(sketches[t.key])
    opt.step()
    for t in opt.targets:
        x = w0[t.key] - lr * sketches[t.key].double() @ proj(opt, t, 0)
        err = (t.weight.double() - x).abs()
        # nearest: within half a bf16 spacing (+ fp32 arithmetic slack before the rounding)
        assert bool((err <= bf16_ulp(x) / 2 + 1e-6 * x.abs()).all())
        assert (t.weight.double() - w0[t.key]).abs().max() > 1e-2


def _tiny_update_run(rounding: str, refresh: bool, steps: int):
    """bf16-only single Linear(16 -> 256), W in [1.25, 1.75) (bf16 spacing 2^-7 there); each step
    ΔW = −lr·G·AᵀA with max |ΔW| = spacing/8. Returns (W0, W_K, accumulated fp64 update U, ulp)."""
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(16, 256, bias=False))
    with torch.no_grad():
        model[0].weight.uniform_(1.25, 1.75)
    model = model.to(torch.bfloat16)
    opt = make_logra(model, targets=("0",), algorithm="sgd", lr=1.0, masters="none", rounding=rounding,
                     rank=16, refresh=refresh, native=NativeConfig(freeze=True))
    (t,) = opt.targets
    ulp = 2.0**-7
    G = torch.randn(256, 16, generator=torch.Generator().manual_seed(17), dtype=F64) + 0.5
    projs = [proj(opt, t, k if refresh else 0) for k in range(steps)]
    sketches = [(G @ A.T).float() for A in projs]
    per_step = [s.double() @ A for s, A in zip(sketches, projs)]
    lr = (ulp / 8) / max(float(d.abs().max()) for d in per_step)
    opt.cfg.lr = lr
    w0 = t.weight.double().clone()
    for s in sketches:
        opt.zero_grad()
        t.sketch.copy_(s)
        opt.step()
    U = -lr * sum(per_step)
    assert bool((w0 + U).abs().ge(1.0).all()) and bool((w0 + U).abs().lt(2.0).all())  # one binade
    return w0, t.weight.double().clone(), U, ulp


def test_tiny_updates_lost_with_nearest_preserved_in_expectation_with_stochastic():
    steps = 128
    w0, wk, U, ulp = _tiny_update_run("nearest", True, steps)
    assert float(U.abs().mean()) > 1.5 * ulp and float(U.abs().max()) > 5 * ulp  # several spacings
    assert torch.equal(wk, w0)  # every step rounds back: all of it is lost

    w0, wk, U, ulp = _tiny_update_run("stochastic", True, steps)
    assert float(U.abs().mean()) > 1.5 * ulp
    # W_K − W0 = U + e, e a sum of K independent zero-mean rounding errors (each |.| < ulp, so
    # variance <= ulp²/4 each): std(<e,U>)/<U,U> <= sqrt(K)/2·ulp/‖U‖ ≈ 0.043 here.
    drift = wk - w0
    slope = float((drift * U).sum() / (U * U).sum())
    bound = math.sqrt(steps) / 2 * ulp / float(U.norm())
    assert bound < 0.05
    assert abs(slope - 1.0) < 0.2  # > 4 bound-std; nearest rounding gives slope 0
    assert float(drift.mean()) == pytest.approx(float(U.mean()), abs=5 * math.sqrt(steps) / 2 * ulp / math.sqrt(U.numel()))


def test_stochastic_rounding_noise_is_fresh_each_step_without_refresh():
    steps = 64
    w0, wk, U, ulp = _tiny_update_run("stochastic", False, steps)
    err = wk - w0 - U
    # independent noise per step: E[e²] <= K·ulp²/4 per entry; allow 1.5x on the mean over 4096 entries
    assert float(err.pow(2).mean()) <= 1.5 * steps * ulp**2 / 4
