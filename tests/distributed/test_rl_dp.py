"""The RL loop's per-rank pieces under data parallelism (2 gloo ranks, no model): the REINFORCE
baseline, and a prompt too long on one rank only.

Each rank scores its own shard of every global batch. ``rl.loop.reinforce_advantages`` must move
the EMA baseline by the mean over the whole global batch, so both ranks hold one baseline (the
checkpoint stores rank 0's) and DP = 2 trains exactly as one process on the concatenated rewards.
Rewards are multiples of 1/8, so every sum and mean is exact and the comparison is bitwise.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed

WEIGHT = 0.25
# step -> rank -> that rank's rewards; the shard means differ, so per-rank baselines would drift apart
REWARDS = [
    [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.125]],
    [[0.5, 0.5, 1.0, 0.0], [1.0, 1.0, 0.875, 1.0]],
    [[0.0, 0.0, 0.0, 0.0], [0.25, 0.75, 1.0, 0.5]],
    [[1.0, 1.0, 1.0, 0.375], [0.0, 0.625, 0.0, 0.0]],
]


def _worker(rank: int, world: int, result_dir: str) -> None:
    import torch.distributed as dist

    from megatron_logra.rl.advantages import EMABaseline
    from megatron_logra.rl.loop import reinforce_advantages

    baseline = EMABaseline(weight=WEIGHT)
    out = {"advantages": [], "baselines": []}
    for step in REWARDS:
        adv = reinforce_advantages(baseline, torch.tensor(step[rank]), dist.group.WORLD)
        out["advantages"].append(adv.tolist())
        out["baselines"].append(baseline.value)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _one_process_reference() -> tuple[list[list[float]], list[float]]:
    """Plain-Python EMA on the concatenated rewards: ``A = r − b``, then ``b ← (1 − w)·b + w·mean``
    (the first batch's mean initialises ``b``)."""
    b, advantages, baselines = None, [], []
    for step in REWARDS:
        rewards = [r for shard in step for r in shard]
        mean = sum(rewards) / len(rewards)
        b = mean if b is None else b
        advantages.append([r - b for r in rewards])
        b = (1 - WEIGHT) * b + WEIGHT * mean
        baselines.append(b)
    return advantages, baselines


def _both_workers(rank: int, world: int, result_dir: str) -> None:
    """One launch for the module's two 2-rank checks (a launch costs seconds of imports)."""
    _worker(rank, world, result_dir)
    _prompt_worker(rank, world, result_dir)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_dp")
    spawn_group(_both_workers, 2, out, str(out))
    return out


def test_reinforce_baseline_is_global_over_two_dp_ranks(two_ranks):
    ranks = [json.loads((two_ranks / f"rank{r}.json").read_text()) for r in range(2)]
    want_adv, want_b = _one_process_reference()
    assert ranks[0]["baselines"] == ranks[1]["baselines"] == want_b
    n = len(REWARDS[0][0])
    for step, want in enumerate(want_adv):
        assert ranks[0]["advantages"][step] + ranks[1]["advantages"][step] == want, f"step {step + 1}"
        assert ranks[1]["advantages"][step] == want[n:]


def test_one_process_baseline_is_bitwise_unchanged():
    """Without a DP group (or without totals) the baseline follows the whole batch's own mean, bitwise
    as before: ``float64 sum / count`` equals ``mean()`` on arbitrary float32 rewards."""
    from megatron_logra.rl.advantages import EMABaseline
    from megatron_logra.rl.loop import reinforce_advantages

    gen = torch.Generator().manual_seed(0)
    old, plain, looped = EMABaseline(weight=0.1), EMABaseline(weight=0.1), EMABaseline(weight=0.1)
    for n in (1, 7, 64, 1000, 4099):
        rewards = torch.randn(n, generator=gen) * 3 + 0.3
        want = old.advantages(rewards)
        assert torch.equal(plain.advantages(rewards, rewards.double().sum().item(), n), want)
        assert torch.equal(reinforce_advantages(looped, rewards, None), want)
        assert plain.value == looped.value == old.value


def test_baseline_totals_are_both_or_neither():
    from megatron_logra.rl.advantages import EMABaseline

    with pytest.raises(ValueError, match="reward_sum and reward_count"):
        EMABaseline().advantages(torch.ones(2), reward_sum=2.0)
    with pytest.raises(ValueError, match="reward_count=0"):
        EMABaseline().advantages(torch.ones(2), reward_sum=0.0, reward_count=0)


def _prompt_worker(rank: int, world: int, result_dir: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_logra.data.tokenizer import build_tokenizer
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rl.prompts import _prompt_batch

    cfg = parse_args_to_config("tiny", [])
    short, long = "1+2", "1+2" * cfg.model.seq_length  # only rank 1 draws the prompt that cannot fit
    tok = build_tokenizer(cfg.tokenizer, [cfg.rl.prompt_template, short])
    c = SimpleNamespace(cfg=cfg, tokenizer=tok, groups=SimpleNamespace(dp=dist.group.WORLD))
    fits = _prompt_batch(c, [SimpleNamespace(prompt=short)], 2)
    try:
        _prompt_batch(c, [SimpleNamespace(prompt=long if rank == 1 else short)], 2)
        outcome = "no error"
    except ValueError as exc:
        outcome = str(exc)
    with open(os.path.join(result_dir, f"prompt{rank}.json"), "w") as f:
        json.dump({"fits": fits, "outcome": outcome}, f)


def test_a_prompt_too_long_on_one_dp_rank_is_the_same_error_on_every_rank(two_ranks):
    """Before, the rank with the long prompt raised alone and the other waited in the step's next
    collective until the process group timed out."""
    ranks = [json.loads((two_ranks / f"prompt{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["fits"] == ranks[1]["fits"] and len(ranks[0]["fits"]) == 2 and ranks[0]["fits"][0]
    assert ranks[0]["outcome"] == ranks[1]["outcome"]
    assert "does not fit: model.seq_length=" in ranks[0]["outcome"]
