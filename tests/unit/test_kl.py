"""Predicted-KL step control (DESIGN §1 "Predicted-KL step control"): the probe and the controller.

References are computed here, independently of ``megatron_logra.kl``:

* the per-position terms against a naive Python loop over positions and vocabulary in float64
  (``½ Σ_v p_v (δz_v/τ − Σ_u p_u δz_u/τ)²`` and ``Σ_v p_v (log p_v − log q_v)``) and against
  ``torch.nn.functional.kl_div``;
* on a megatron-core GPT the exact KL is measured from the model's logits before and after
  the weights are changed *by hand* (``W ← W − α·D·A`` with ``A`` from the sketch set, the
  method's input) and evaluated with the naive float64 formula above;
* controller arithmetic is written out by hand next to each assertion.

Tolerances. The GPT runs in fp32. With ``update_ratio=1e-3`` and ``α = 0.05`` (so
‖ΔW‖/‖W‖ = 5e-5) the two error sources of "exact ≈ α²·pred" are (i) the third-order term of
the KL expansion, relative size ∝ α (measured ≈ 4e-4 per 0.1 of α here), and (ii) fp32
rounding of logits (≈ 1e-7 absolute against logit changes of ≈ 1e-3, ≈ 3e-4 relative in the
KL). Both stay below the issue's target of 1e-3 relative; a wrong prediction (a missing layer,
a wrong temperature power, a missing ½ or centring) is off by tens of percent or more.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_logra.kl.controller import KLConfig, KLController, KLControlError, cosine_budget
from megatron_logra.kl.fd_probe import fd_step, perturbation_hooks, predicted_kl_fd
from megatron_logra.kl.probe import (
    ProbeBatch,
    exact_kl_terms,
    measure_kl,
    predicted_kl,
    predicted_kl_terms,
    probe_method,
)

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


# --------------------------------------------------------------------------- naive references


def naive_pred(z_NV: torch.Tensor, dz_NV: torch.Tensor, tau: float) -> list[float]:
    """½ Σ_v p_v (δz_v/τ − Σ_u p_u δz_u/τ)² per position, scalar loops in float64."""
    out = []
    for z, dz in zip(z_NV.double().tolist(), dz_NV.double().tolist()):
        m = max(x / tau for x in z)
        e = [math.exp(x / tau - m) for x in z]
        s = sum(e)
        p = [x / s for x in e]
        mean = sum(pv * d / tau for pv, d in zip(p, dz))
        out.append(0.5 * sum(pv * (d / tau - mean) ** 2 for pv, d in zip(p, dz)))
    return out


def naive_kl(old_NV: torch.Tensor, new_NV: torch.Tensor, tau: float) -> list[float]:
    """Σ_v p_v (log p_v − log q_v), p = softmax(old/τ), q = softmax(new/τ), float64 loops."""

    def log_softmax(row):
        m = max(x / tau for x in row)
        lse = m + math.log(sum(math.exp(x / tau - m) for x in row))
        return [x / tau - lse for x in row]

    out = []
    for zo, zn in zip(old_NV.double().tolist(), new_NV.double().tolist()):
        lp, lq = log_softmax(zo), log_softmax(zn)
        out.append(sum(math.exp(a) * (a - b) for a, b in zip(lp, lq)))
    return out


def rand_logits(seed: int, n: int = 6, v: int = 11, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=gen, dtype=F64) * scale, torch.randn(n, v, generator=gen, dtype=F64)


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("tau", [1.0, 0.6, 1.7])
def test_predicted_kl_terms_match_naive(tau):
    z, dz = rand_logits(1)
    got = predicted_kl_terms(z.float(), dz.float(), tau)
    assert got.dtype == F64 and got.shape == (6,)
    want = torch.tensor(naive_pred(z.float(), dz.float(), tau), dtype=F64)
    assert (want > 1e-3).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_predicted_kl_terms_temperature_is_applied_squared():
    # the same logits at τ and a tangent scaled: pred(z, c·δz; τ) = c²·pred(z, δz; τ), and
    # pred(τ·z, τ·δz; τ) = pred(z, δz; 1) exactly (both sides see the same softmax and δz/τ)
    z, dz = rand_logits(2)
    tau = 0.7
    torch.testing.assert_close(predicted_kl_terms(z, 3.0 * dz, tau), 9.0 * predicted_kl_terms(z, dz, tau), rtol=1e-12, atol=0)
    torch.testing.assert_close(predicted_kl_terms(tau * z, tau * dz, tau), predicted_kl_terms(z, dz, 1.0), rtol=1e-12, atol=0)
    # τ ≠ 1 changes the value (a wrong temperature power would not be caught by the lines above)
    assert not torch.allclose(predicted_kl_terms(z, dz, tau), predicted_kl_terms(z, dz, 1.0), rtol=1e-2)


def test_predicted_kl_terms_shift_invariance():
    # adding the same constant to every logit of a position changes no probability: KL 0
    z, _ = rand_logits(3)
    shift = torch.arange(6, dtype=F64)[:, None].expand(6, 11) * 0.37
    got = predicted_kl_terms(z, shift, 0.8)
    # E[x²] − E[x]² in float64 with x ≈ 2.3: cancellation leaves ≲ 1e-15·x²
    assert got.abs().max().item() < 1e-13


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_exact_kl_terms_match_kl_div_and_naive(tau):
    old, d = rand_logits(4)
    new = old + 0.5 * d
    got = exact_kl_terms(old.float(), new.float(), tau)
    assert got.dtype == F64 and got.shape == (6,)
    o, n = old.float().double() / tau, new.float().double() / tau
    ref = F.kl_div(torch.log_softmax(n, -1), torch.log_softmax(o, -1), reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(got, torch.tensor(naive_kl(old.float(), new.float(), tau), dtype=F64), rtol=1e-10, atol=1e-15)
    assert (got > 1e-3).all()
    # identical or shifted logits: 0
    assert exact_kl_terms(old, old + 5.0, tau).abs().max().item() < 1e-12


def test_exact_over_predicted_converges_linearly_to_one():
    """exact(z, z + ε·δz) / (ε²·pred) = 1 + O(ε): the relative error shrinks ∝ ε."""
    z, dz = rand_logits(5, n=8, v=13)
    tau = 0.7
    pred = predicted_kl_terms(z, dz, tau).sum().item()
    errs = []
    for eps in (1e-1, 1e-2, 1e-3):
        exact = exact_kl_terms(z, z + eps * dz, tau).sum().item()
        errs.append(abs(exact / (eps * eps * pred) - 1.0))
    assert errs[0] > 1e-3  # the third-order term is visible at ε = 0.1 (generic data)
    for big, small in zip(errs, errs[1:]):
        assert 0.05 < small / big < 0.2, errs  # ×10 smaller ε -> ≈ ×10 smaller error
    assert errs[-1] < 1e-3


# --------------------------------------------------------------------------- controller


def test_step_size_rejects_untrustworthy_predictions():
    ctl = KLController(KLConfig())
    for bad in (float("nan"), -1e-9, float("inf"), float("-inf")):
        with pytest.raises(KLControlError):
            ctl.step_size(bad, 1)


def test_step_size_values_zero_and_cap():
    ctl = KLController(KLConfig(budget_start=2e-4, budget_end=2e-5, horizon=300, alpha_max=3.0))
    # update 1: budget = b0 = 2e-4; pred 8e-4 -> α = sqrt(2e-4 / 8e-4) = 0.5
    alpha, beff = ctl.step_size(8e-4, 1)
    assert alpha == pytest.approx(0.5, rel=1e-12) and beff == pytest.approx(2e-4, rel=1e-12)
    # pred 0: α = 1 (the step changes nothing the probe can see)
    assert ctl.step_size(0.0, 1) == (1.0, pytest.approx(2e-4, rel=1e-12))
    # pred 1e-6: sqrt(2e-4 / 1e-6) = 14.1 > α_max = 3 -> 3
    assert ctl.step_size(1e-6, 1)[0] == 3.0
    # just under the cap: sqrt(2e-4 / 2.5e-5) = sqrt(8) = 2.828
    assert ctl.step_size(2.5e-5, 1)[0] == pytest.approx(math.sqrt(8.0), rel=1e-12)


def test_mode_none_gives_unit_step():
    ctl = KLController(KLConfig(mode="none"))
    assert ctl.step_size(123.0, 1)[0] == 1.0
    assert ctl.step_size(1e-12, 5)[0] == 1.0


def test_cosine_budget_endpoints_and_midpoint():
    b0, bf, h = 2e-4, 2e-5, 300
    assert cosine_budget(1, b0, bf, h) == pytest.approx(b0, rel=1e-12)
    assert cosine_budget(0, b0, bf, h) == pytest.approx(b0, rel=1e-12)  # clamped before the start
    assert cosine_budget(h + 1, b0, bf, h) == pytest.approx(bf, rel=1e-12)
    assert cosine_budget(10 * h, b0, bf, h) == pytest.approx(bf, rel=1e-12)
    # update 151 = progress 150/300 = ½: cos(π/2) = 0 -> (b0 + bf)/2 = 1.1e-4
    assert cosine_budget(1 + h // 2, b0, bf, h) == pytest.approx(1.1e-4, rel=1e-12)
    # update 101 = progress 1/3: bf + ½(b0 − bf)(1 + cos(π/3)) = 2e-5 + 0.9e-4·1.5 = 1.55e-4
    assert cosine_budget(101, b0, bf, h) == pytest.approx(1.55e-4, rel=1e-12)
    ctl = KLController(KLConfig(budget_start=b0, budget_end=bf, horizon=h))
    assert ctl.budget(151) == pytest.approx(1.1e-4, rel=1e-12)
    values = [ctl.budget(u) for u in range(1, h + 2)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_mismatch_ema_and_effective_budget():
    ctl = KLController(KLConfig(budget_start=2e-4, budget_end=2e-5, horizon=300))
    # M ← 0.7·0 + 0.3·1e-4 = 3e-5
    assert ctl.observe_mismatch(1e-4) == pytest.approx(3e-5, rel=1e-12)
    # budget_eff = max(2e-4 − 3e-5, 1e-4) = 1.7e-4
    assert ctl.effective_budget(1) == pytest.approx(1.7e-4, rel=1e-12)
    alpha, beff = ctl.step_size(1.7e-4 / 4.0, 1)  # α = sqrt(1.7e-4 / (1.7e-4/4)) = 2
    assert alpha == pytest.approx(2.0, rel=1e-12) and beff == pytest.approx(1.7e-4, rel=1e-12)
    # a negative gap counts as 0: M ← 0.7·3e-5 + 0 = 2.1e-5
    assert ctl.observe_mismatch(-0.5) == pytest.approx(2.1e-5, rel=1e-12)
    # a large gap: M ← 0.7·2.1e-5 + 0.3·1e-3 = 1.47e-5 + 3e-4 = 3.147e-4 > budget -> floor ½·2e-4
    assert ctl.observe_mismatch(1e-3) == pytest.approx(3.147e-4, rel=1e-12)
    assert ctl.effective_budget(1) == pytest.approx(1e-4, rel=1e-12)
    assert ctl.step_size(1e-4, 1)[0] == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(KLControlError):
        ctl.observe_mismatch(float("nan"))


def test_calibration_ema_with_clipping():
    ctl = KLController(KLConfig(mode="calibrated", budget_start=2e-4, calibration_clip=10.0))
    # ratio 2e-4 / 1e-4 = 2: c ← 0.7·1 + 0.3·2 = 1.3
    ctl.observe_actual(2e-4, 1e-4)
    assert ctl.calibration == pytest.approx(1.3, rel=1e-12)
    # α = sqrt(b / (c·pred)) = sqrt(2e-4 / (1.3·1e-4))
    assert ctl.step_size(1e-4, 1)[0] == pytest.approx(math.sqrt(2.0 / 1.3), rel=1e-12)
    # ratio 100 clipped to 10: c ← 0.7·1.3 + 0.3·10 = 3.91
    ctl.observe_actual(1e-2, 1e-4)
    assert ctl.calibration == pytest.approx(3.91, rel=1e-12)
    # a negative actual counts as 0, clipped up to 1/10: c ← 0.7·3.91 + 0.3·0.1 = 2.767
    ctl.observe_actual(-1e-5, 1e-4)
    assert ctl.calibration == pytest.approx(2.767, rel=1e-12)
    # untrustworthy observations leave c alone
    for actual, pred in ((float("nan"), 1e-4), (1e-4, 0.0), (1e-4, float("inf")), (1e-4, -1.0)):
        ctl.observe_actual(actual, pred)
        assert ctl.calibration == pytest.approx(2.767, rel=1e-12)
    # mode "predicted" keeps the arithmetic but ignores c in the step size
    plain = KLController(KLConfig(mode="predicted", budget_start=2e-4))
    plain.observe_actual(2e-4, 1e-4)
    assert plain.calibration == pytest.approx(1.3, rel=1e-12)
    assert plain.step_size(2e-4 / 4.0, 1)[0] == pytest.approx(2.0, rel=1e-12)


def test_controller_state_dict_round_trip():
    ctl = KLController(KLConfig(mode="calibrated"))
    ctl.observe_mismatch(2e-5)
    ctl.observe_actual(3e-4, 1e-4)
    ctl.finish_update()
    ctl.finish_update()
    state = ctl.state_dict()
    other = KLController(KLConfig(mode="calibrated"))
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert (other.mismatch, other.calibration, other.num_updates) == (pytest.approx(6e-6), pytest.approx(1.6), 2)
    assert other.step_size(3e-5, 7) == ctl.step_size(3e-5, 7)


@pytest.mark.parametrize("kwargs, field", [
    ({"mode": "exact"}, "kl.mode"),
    ({"horizon": 0}, "kl.horizon"),
    ({"alpha_max": 0.0}, "kl.alpha_max"),
    ({"budget_start": 0.0}, "kl.budget_start"),
    ({"budget_end": -1e-5}, "kl.budget_end"),
    ({"mismatch_decay": 1.0}, "kl.mismatch_decay"),
    ({"calibration_decay": -0.1}, "kl.calibration_decay"),
    ({"calibration_clip": 0.5}, "kl.calibration_clip"),
    ({"probe_sequences": 0}, "kl.probe_sequences"),
    ({"probe_max_tokens": 0}, "kl.probe_max_tokens"),
    ({"mode": "calibrated", "measure_actual": False}, "kl.measure_actual"),
])
def test_kl_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        KLConfig(**kwargs)


# --------------------------------------------------------------------------- megatron GPT probe

B, S, V = 2, 16, 64
ALPHA = 0.05


@pytest.fixture(scope="module")
def gpt_step(groups):
    """(model, optimizer, prepared paper-recipe update, probe, batch) after one forward/backward.

    Default targets (linear_qkv, linear_proj, linear_fc1, linear_fc2) × 2 layers = 8 targets."""
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.train.step import Batch, forward_backward

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(ModelConfig(init_std=0.1, vocab_size=V), groups, seed=3)
    opt = build_optimizer(model, OptimizerConfig(
        logra=LograConfig(rank=8, recipe="paper", update_ratio=1e-3), native=NativeConfig(freeze=True)), groups)
    assert len(opt.targets) == 8
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    pos = torch.arange(S)[None].expand(B, S).contiguous()
    mask = torch.ones(B, S)
    mask[:, :4] = 0.0  # "prompt" positions
    mask[1, 13:] = 0.0  # padding
    batch = Batch(tokens, labels, mask, pos)
    opt.zero_grad()
    r = forward_backward(model, [batch], groups)
    update = opt.prepare(num_tokens=r.num_tokens)
    assert not update.skipped and set(update.directions) == {t.key for t in opt.targets}
    return model, opt, update, ProbeBatch(tokens, pos, mask), batch


@torch.no_grad()
def logits_of(model, probe: ProbeBatch) -> torch.Tensor:
    z = model(probe.tokens, probe.position_ids, None)
    assert z.shape == (B, S, V)  # batch-major (B != S, so a [s, b] layout would fail)
    return z[probe.mask]


@torch.no_grad()
def set_step(opt, update, saved: dict, alpha: float) -> None:
    """W ← W₀ − α·D·A for every target, by hand."""
    for t in opt.targets:
        proj = opt.sketches.projection_for(t, update.update_index)
        t.weight.copy_(saved[t.key] - (alpha * update.directions[t.key]) @ proj)


def exact_mean_kl(old_NV, new_NV, tau) -> float:
    vals = naive_kl(old_NV, new_NV, tau)
    return sum(vals) / len(vals)


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_gpt_predicted_kl_equals_exact_small_step(groups, gpt_step, tau):
    model, opt, update, probe, _ = gpt_step
    saved = {t.key: t.weight.detach().clone() for t in opt.targets}
    try:
        old = logits_of(model, probe)
        pred, old_logits = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups,
                                        temperature=tau)
        # the probe touched no weight and returned the primal logits of the valid positions
        for t in opt.targets:
            assert torch.equal(t.weight, saved[t.key]), t.key
        assert old_logits.shape == (int(probe.mask.sum()), V) == (21, V)
        torch.testing.assert_close(old_logits, old, rtol=0, atol=1e-6)
        assert pred > 0 and math.isfinite(pred)

        set_step(opt, update, saved, ALPHA)
        new = logits_of(model, probe)
        exact = exact_mean_kl(old, new, tau)
        assert exact > 1e-8  # the step is visible
        rel = abs(exact / (ALPHA**2 * pred) - 1.0)
        assert rel <= 1e-3, (exact, ALPHA**2 * pred, rel)
        # measure_kl agrees with the naive exact KL from the same logits
        assert measure_kl(model, probe, old_logits, groups, temperature=tau) == pytest.approx(exact, rel=1e-6)

        # α² scaling: at 2α the actual KL is 4× (to within the O(α) third-order term)
        set_step(opt, update, saved, 2 * ALPHA)
        exact2 = exact_mean_kl(old, logits_of(model, probe), tau)
        assert abs(exact2 / (4.0 * exact) - 1.0) <= 1e-3, exact2 / exact
        assert abs(exact2 / ((2 * ALPHA) ** 2 * pred) - 1.0) <= 1e-3
        # and the probe is quadratic in the direction: D -> 2·D gives 4·pred
        for t in opt.targets:
            t.weight.copy_(saved[t.key])
        doubled = {k: 2.0 * d for k, d in update.directions.items()}
        pred2, _ = predicted_kl(model, opt.sketches, doubled, update.update_index, probe, groups, temperature=tau)
        assert pred2 == pytest.approx(4.0 * pred, rel=1e-5)
    finally:
        with torch.no_grad():
            for t in opt.targets:
                t.weight.copy_(saved[t.key])


def test_gpt_prediction_sees_every_target(groups, gpt_step):
    """Dropping one target's direction (D = 0) changes the prediction: every layer contributes."""
    model, opt, update, probe, _ = gpt_step
    pred, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups)
    for t in opt.targets:
        dirs = dict(update.directions)
        dirs[t.key] = torch.zeros_like(dirs[t.key])
        partial, _ = predicted_kl(model, opt.sketches, dirs, update.update_index, probe, groups)
        assert abs(partial / pred - 1.0) > 1e-4, t.key


def test_gpt_temperature_changes_prediction(groups, gpt_step):
    model, opt, update, probe, _ = gpt_step
    p1, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups, temperature=1.0)
    p7, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups, temperature=0.7)
    assert abs(p7 / p1 - 1.0) > 0.05


def test_predicted_kl_chunking_does_not_change_the_mean(groups, gpt_step):
    model, opt, update, probe, _ = gpt_step
    whole, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups, chunk=1024)
    chunked, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups, chunk=5)
    assert chunked == pytest.approx(whole, rel=1e-12)


def test_kl_chunks_bound_the_float64_temporaries():
    from megatron_logra.kl.probe import CHUNK_BYTES, chunk_rows

    assert chunk_rows(1024, 160) == 1024  # small vocabularies: the requested chunk
    rows = chunk_rows(1024, 151936)  # Qwen2.5's vocabulary on one rank
    assert rows * 151936 * 8 <= CHUNK_BYTES < (rows + 1) * 151936 * 8
    assert chunk_rows(1024, 151936 // 8) > rows  # a TP shard of it: more rows per chunk
    assert chunk_rows(1024, 10**9) == 1  # never zero rows


def test_predicted_kl_without_valid_positions_raises(groups, gpt_step):
    model, opt, update, probe, _ = gpt_step
    empty = ProbeBatch(probe.tokens, probe.position_ids, torch.zeros_like(probe.mask, dtype=torch.float32))
    with pytest.raises(KLControlError):
        predicted_kl(model, opt.sketches, update.directions, update.update_index, empty, groups)
    with pytest.raises(KLControlError):
        measure_kl(model, empty, torch.zeros(0, V), groups)


def test_perturbation_hooks_give_the_logits_of_the_stepped_weights(groups, gpt_step):
    """The finite-difference probe's primal perturbation is exactly the forward of W − h·D·A."""
    model, opt, update, probe, _ = gpt_step
    saved = {t.key: t.weight.detach().clone() for t in opt.targets}
    try:
        for h in (1.0, -0.5):
            with perturbation_hooks(opt.sketches, update.directions, h, groups.tp):
                hooked = logits_of(model, probe)
            for t in opt.targets:
                assert torch.equal(t.weight, saved[t.key]), t.key
            set_step(opt, update, saved, h)
            by_hand = logits_of(model, probe)
            for t in opt.targets:
                t.weight.data.copy_(saved[t.key])
            effect = (by_hand - logits_of(model, probe)).abs().max().item()
            assert effect > 1e-4  # the step is visible
            # fp32, different association only (x·(W − hDA)ᵀ vs x·Wᵀ − h(x·Aᵀ)·Dᵀ)
            assert (hooked - by_hand).abs().max().item() <= 1e-3 * effect
    finally:
        with torch.no_grad():
            for t in opt.targets:
                t.weight.copy_(saved[t.key])


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_finite_difference_prediction_equals_jvp_and_exact_kl(groups, gpt_step, tau):
    """Central differences across the α = 1 step (h = 1) predict what forward-mode AD predicts,
    and both match the exact KL of a small step measured with the weights changed by hand."""
    model, opt, update, probe, _ = gpt_step
    saved = {t.key: t.weight.detach().clone() for t in opt.targets}
    try:
        jvp, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups,
                              temperature=tau)
        fd, old_logits = predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, temperature=tau)
        for t in opt.targets:
            assert torch.equal(t.weight, saved[t.key]), t.key
        torch.testing.assert_close(old_logits, logits_of(model, probe), rtol=0, atol=1e-6)
        assert abs(fd / jvp - 1.0) <= 1e-3, (fd, jvp)
        old = logits_of(model, probe)
        set_step(opt, update, saved, ALPHA)
        exact = exact_mean_kl(old, logits_of(model, probe), tau)
        assert abs(exact / (ALPHA**2 * fd) - 1.0) <= 2e-3, (exact, ALPHA**2 * fd)
        # a wrong direction is seen: dropping a target changes the finite-difference prediction too
        for t in opt.targets:
            t.weight.data.copy_(saved[t.key])
        dirs = dict(update.directions)
        dropped = opt.targets[0].key
        dirs[dropped] = torch.zeros_like(dirs[dropped])
        partial, _ = predicted_kl_fd(model, opt.sketches, dirs, probe, groups, temperature=tau)
        assert abs(partial / fd - 1.0) > 1e-4
        with pytest.raises(ValueError, match="fd_step"):
            predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=0.0)
    finally:
        with torch.no_grad():
            for t in opt.targets:
                t.weight.copy_(saved[t.key])


def test_probe_method_resolution(gpt_step):
    _, opt, _, _, _ = gpt_step
    assert probe_method("auto", opt.sketches) == "jvp"  # megatron-core local layers have jvp rules
    assert probe_method("finite_difference", opt.sketches) == "finite_difference"
    assert probe_method("auto", opt.sketches, pp_size=2) == "finite_difference"  # tangents cannot cross stages
    with pytest.raises(ValueError, match="pipeline"):
        probe_method("jvp", opt.sketches, pp_size=2)
    target = opt.sketches.targets[0]
    target.sequence_parallel = True
    try:
        assert probe_method("auto", opt.sketches) == "finite_difference"
        with pytest.raises(ValueError, match="sequence parallelism"):
            probe_method("jvp", opt.sketches)
    finally:
        target.sequence_parallel = False
    with pytest.raises(ValueError, match="kl.probe"):
        probe_method("secant", opt.sketches)
    with pytest.raises(ValueError, match="kl.probe"):
        KLConfig(probe="secant")
    with pytest.raises(ValueError, match="kl.fd_step"):
        KLConfig(fd_step=-1.0)


def test_gpt_apply_matches_manual_step_and_measured_kl(groups, gpt_step):
    """The optimizer's own apply(update, α) is the step the probe predicted (runs last: it
    advances the projection index)."""
    model, opt, update, probe, _ = gpt_step
    saved = {t.key: t.weight.detach().clone() for t in opt.targets}
    projs = {t.key: opt.sketches.projection_for(t, update.update_index).clone() for t in opt.targets}
    pred, old_logits = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups)
    opt.apply(update, ALPHA)
    for t in opt.targets:
        want = saved[t.key] - (ALPHA * update.directions[t.key]) @ projs[t.key]
        torch.testing.assert_close(t.weight.detach(), want, rtol=0, atol=1e-7)
        assert (t.weight - saved[t.key]).abs().max() > 1e-6  # >> the 1e-7 tolerance
    actual = measure_kl(model, probe, old_logits, groups)
    assert abs(actual / (ALPHA**2 * pred) - 1.0) <= 1e-3


def test_finite_difference_probe_on_bf16_weights_with_the_paper_step(groups):
    """bf16 outputs cannot resolve the paper recipe's α = 1 step (‖ΔW‖/‖W‖ = 6e-5, far below bf16's
    2⁻⁸ spacing): the automatic step h (``kl.fd_step=0``) lifts the perturbation above it, and the
    prediction then matches forward-mode AD on an fp32 twin holding the same (bf16-rounded) weights."""
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.train.step import Batch, forward_backward

    optim_cfg = OptimizerConfig(logra=LograConfig(rank=8, recipe="paper", update_ratio=6e-5),
                                native=NativeConfig(freeze=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(ModelConfig(init_std=0.1, vocab_size=V, params_dtype="bfloat16"), groups, seed=3)
        twin = build_gpt(ModelConfig(init_std=0.1, vocab_size=V), groups, seed=3)
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items() if v is not None}, strict=False)
    opt = build_optimizer(model, optim_cfg, groups)
    twin_opt = build_optimizer(twin, optim_cfg, groups)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    pos = torch.arange(S)[None].expand(B, S).contiguous()
    mask = torch.ones(B, S)
    mask[:, :4] = 0.0
    opt.zero_grad()
    r = forward_backward(model, [Batch(tokens, torch.randint(0, V, (B, S), generator=gen), mask, pos)], groups)
    update = opt.prepare(num_tokens=r.num_tokens)
    probe = ProbeBatch(tokens, pos, mask)
    ref, _ = predicted_kl(twin, twin_opt.sketches, update.directions, update.update_index, probe, groups)
    relative = opt.relative_update_norm(update, 1.0)
    assert relative == pytest.approx(6e-5, rel=1e-3)
    h = fd_step(0.0, 0.005, relative, torch.bfloat16)
    assert h == pytest.approx(0.005 / relative) and fd_step(0.0, 0.005, relative, torch.float32) == 1.0
    assert fd_step(2.5, 0.02, relative, torch.bfloat16) == 2.5
    auto, _ = predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=h)
    naive, _ = predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=1.0)
    assert abs(auto / ref - 1.0) <= 0.1  # measured -3.3% (the fp32 twin at the same h: -1.4%)
    assert abs(naive / ref - 1.0) > 0.5  # h = 1 is lost in bf16 rounding (measured +991%)
