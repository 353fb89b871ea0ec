"""GSPO (``rl.loss.kind=gspo``, slime's ``--advantage-estimator gspo``): the loss and its per-token gradient against a
per-sequence Python reference, equal to PPO-clip where every token of a completion has the same log-ratio, rows
without loss tokens inert; the slime flags; and a real RL step trains with it."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.losses import LossConfig, gspo_loss, ppo_clip_loss, rl_loss

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _case(seed: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(4, 7, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 7).contiguous()  # one advantage per row
    mask = (torch.rand(4, 7, generator=g) < 0.75).double()
    mask[3] = 0.0  # a completion without loss tokens
    return logp, old, adv, mask


def _reference(logp, old, adv, mask, lo, hi, c=0.0):
    """Per row in plain floats: s = exp(mean of the masked log-ratios); the row's tokens each add the clipped
    surrogate at s; and the gradient on each masked token: −s·A where the unclipped term is the one taken."""
    total, grads = 0.0, torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        if not idx:
            continue
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in idx) / len(idx))
        a = adv[i, 0].item()
        un, cl = s * a, min(max(s, 1 - lo), 1 + hi) * a
        per = -min(un, cl)
        capped = bool(c) and a < 0 and -c * a < per
        total += len(idx) * (min(per, -c * a) if capped else per)
        takes_unclipped = un <= cl and not capped
        for t in idx:
            grads[i, t] = -s * a if takes_unclipped else 0.0
    return total, grads


@pytest.mark.parametrize("seed, spread, lo, hi, c", [(0, 0.05, 3e-4, 4e-4, 0.0), (1, 0.3, 0.2, 0.28, 0.0),
                                                      (2, 1.0, 0.2, 0.28, 3.0), (3, 0.01, 0.2, 0.28, 0.0)])
def test_gspo_matches_the_per_sequence_reference(seed, spread, lo, hi, c):
    logp, old, adv, mask = _case(seed, spread)
    lp = logp.clone().requires_grad_(True)
    loss = gspo_loss(lp, old, adv, mask, lo, hi, c)
    loss.backward()
    want, want_grad = _reference(logp, old, adv, mask, lo, hi, c)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp.grad * mask, want_grad, rtol=1e-10, atol=1e-12)
    assert torch.all(lp.grad[3] == 0)


def test_gspo_is_ppo_where_every_token_of_a_row_has_the_same_log_ratio():
    logp, _, adv, mask = _case(4, 0.0)
    shift = torch.tensor([[0.1], [-0.05], [0.3], [0.0]], dtype=torch.float64)
    old = logp - shift  # each row's tokens share one ratio
    assert gspo_loss(logp, old, adv, mask, 0.2, 0.28).item() == pytest.approx(
        ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28).item(), rel=1e-12)


def test_the_config_and_slimes_flag_choose_gspo():
    logp, old, adv, mask = _case(5, 0.1)
    cfg = LossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4)
    assert torch.equal(rl_loss(cfg, logp, old, adv, mask), gspo_loss(logp, old, adv, mask, 3e-4, 4e-4))
    run = parse_args_to_config("tiny", ["--advantage-estimator", "gspo", "--eps-clip", "3e-4", "--eps-clip-high",
                                        "4e-4"])
    assert (run.rl.loss.kind, run.rl.loss.clip_low, run.rl.loss.clip_high) == ("gspo", 3e-4, 4e-4)
    assert run.rl.advantage.estimator == "grpo"
    with pytest.raises(ValueError, match="rl.loss.kind"):
        parse_args_to_config("tiny", ["--advantage-estimator", "gspo", "--use-tis"])
    with pytest.raises(ValueError, match="choose tis, ppo or gspo"):
        LossConfig(kind="gpo")


def test_an_rl_step_trains_with_gspo(tmp_path, monkeypatch):
    from support.run_fixtures import rl_components

    from megatron_logra.rl.loop import rl_update

    with rl_components(tmp_path / "run", ["rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4",
                                          "rl.micro_batch_size=16", "task.num_eval=0", "rl.loss.kind=gspo",
                                          "rl.loss.clip_low=3e-4", "rl.loss.clip_high=4e-4"]) as (comps, state):
        returned: list[float] = []

        def score(problem, completion):
            returned.append(float(len(returned) % 2 == 0))
            return returned[-1], returned[-1] == 1.0

        monkeypatch.setattr(comps.task, "score", score)
        params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
        record = rl_update(comps, state)
        assert not record["skipped"] and math.isfinite(record["loss"]) and record["alpha"] is not None
        assert any(not torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())
