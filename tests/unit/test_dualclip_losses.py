"""Dual-clip PPO (``rl.loss.clip_c``, slime's ``--eps-clip-c``) and the TIS weight's floor (``rl.loss.tis_floor``,
``--tis-clip-low``): the losses and their gradients against per-token Python references, the fields' checks, and
the slime flags."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.losses import LossConfig, ppo_clip_loss, rl_loss, tis_pg_loss


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 9, generator=g, dtype=torch.float64) * 4)
    old = logp + torch.randn(3, 9, generator=g, dtype=torch.float64) * 1.5  # ratios from ~0.02 to ~90
    adv = torch.randn(3, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 9, generator=g) < 0.8).double()
    return logp, old, adv, mask


def _ppo_reference(logp, old, adv, mask, lo, hi, c):
    """Per token in plain floats: −min(ρA, clip(ρ)A), then for A < 0 at most −c·A."""
    total = 0.0
    for lp, op, a, m in zip(logp.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist(),
                            mask.flatten().tolist()):
        rho = math.exp(lp - op)
        loss = -min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)
        if c and a < 0:
            loss = min(loss, -c * a)
        total += m * loss
    return total


@pytest.mark.parametrize("c", [0.0, 1.5, 3.0])
def test_dual_clip_matches_the_per_token_reference(c):
    logp, old, adv, mask = _case()
    got = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28, c).item()
    assert got == pytest.approx(_ppo_reference(logp, old, adv, mask, 0.2, 0.28, c), rel=1e-12)


def test_dual_clip_bounds_negative_advantage_tokens_and_stops_their_gradient():
    logp, old, adv, mask = _case(1)
    rho = torch.exp(logp - old)
    capped = (adv < 0) & (rho * -adv > 3.0 * -adv) & (mask > 0)  # ρ > c on a negative-advantage token
    assert capped.any()
    lp = logp.clone().requires_grad_(True)
    ppo_clip_loss(lp, old, adv, mask, 0.2, 0.28, 3.0).backward()
    assert torch.all(lp.grad[capped] == 0)
    lp0 = logp.clone().requires_grad_(True)
    ppo_clip_loss(lp0, old, adv, mask, 0.2, 0.28, 0.0).backward()
    assert torch.all(lp0.grad[capped] != 0)  # without the dual clip these tokens push
    free = ~capped & (mask > 0)
    torch.testing.assert_close(lp.grad[free], lp0.grad[free])


def test_the_tis_floor_raises_small_importance_weights_only():
    logp, old, adv, mask = _case(2)
    weight = torch.exp(logp - old)
    assert (weight < 0.5).any() and (weight > 2).any()
    want = -(weight.clamp(0.5, 2.0) * adv * logp * mask).sum()
    assert tis_pg_loss(logp, old, adv, mask, 2.0, 0.5).item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.equal(tis_pg_loss(logp, old, adv, mask, 2.0, 0.0), tis_pg_loss(logp, old, adv, mask, 2.0))


def test_rl_loss_passes_the_new_fields():
    logp, old, adv, mask = _case(3)
    ppo = LossConfig(kind="ppo", clip_c=2.0)
    assert rl_loss(ppo, logp, old, adv, mask).item() == pytest.approx(
        _ppo_reference(logp, old, adv, mask, ppo.clip_low, ppo.clip_high, 2.0), rel=1e-12)
    tis = LossConfig(kind="tis", tis_floor=0.7)
    assert torch.equal(rl_loss(tis, logp, old, adv, mask), tis_pg_loss(logp, old, adv, mask, 2.0, 0.7))


@pytest.mark.parametrize("field, value, match", [
    ("clip_c", 1.0, "must be > 1"), ("clip_c", -2.0, "must be > 1"), ("tis_floor", -0.1, r"\[0, rl.loss.tis_cap"),
    ("tis_floor", 2.0, r"\[0, rl.loss.tis_cap=2.0\)")])
def test_bad_values_are_refused_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=rf"rl.loss.{field}=.*{match}"):
        LossConfig(**{field: value})


def test_slimes_flags_set_the_fields(caplog):
    cfg = parse_args_to_config("tiny", ["--eps-clip", "0.2", "--eps-clip-c", "3"])
    assert (cfg.rl.loss.kind, cfg.rl.loss.clip_c) == ("ppo", 3.0)
    cfg = parse_args_to_config("tiny", ["--use-tis", "--tis-clip", "2", "--tis-clip-low", "0.1", "--eps-clip-c", "3"])
    assert (cfg.rl.loss.kind, cfg.rl.loss.tis_floor, cfg.rl.loss.clip_c) == ("tis", 0.1, 3.0)
    with pytest.raises(ValueError, match="rl.loss.clip_c"):
        parse_args_to_config("tiny", ["--eps-clip-c", "0.5"])
