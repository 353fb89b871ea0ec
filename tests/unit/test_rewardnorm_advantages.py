"""``rl.advantage.baseline`` (slime's ``--disable-rewards-normalization``): with ``none`` the GRPO advantages are
the raw rewards (no group mean, no std division, whatever ``scale_by_std``), checked against hand-computed
values; the field is validated naming the fix; the slime flag sets it and is no longer refused."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.rl.advantages import AdvantageConfig, grpo_advantages

REWARDS = [1.0, 1.0, 1.0, 1.0, -1.0, 0.5, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]


def test_without_a_baseline_the_rewards_are_the_advantages():
    rewards = torch.tensor(REWARDS)
    for scale in (True, False):
        got = grpo_advantages(rewards, 4, scale_by_std=scale, eps=0.5, baseline="none")
        assert got.dtype == torch.float32 and got.tolist() == REWARDS  # uniform groups keep their rewards
    assert grpo_advantages(torch.tensor([3, -2]), 1, baseline="none").tolist() == [3.0, -2.0]  # ints: float32
    got = grpo_advantages(rewards, 4, baseline="none")
    got[0] = 9.0
    assert rewards[0] == 1.0  # a copy, not the rewards themselves


def test_the_group_mean_baseline_is_unchanged():
    # by hand: group 2 = [-1, .5, 0, 2], mean .375, population std sqrt(((1.375)^2+(.125)^2+(.375)^2+(1.625)^2)/4)
    centred = [-1.375, 0.125, -0.375, 1.625]
    std = (sum(c * c for c in centred) / 4) ** 0.5
    got = grpo_advantages(torch.tensor(REWARDS), 4, baseline="group_mean").tolist()
    assert got[:4] == [0.0] * 4 and got[8:] == [0.0] * 4
    assert got[4:8] == pytest.approx([c / (std + 1e-6) for c in centred], rel=1e-6)
    assert grpo_advantages(torch.tensor(REWARDS), 4) == pytest.approx(got)  # the default


def test_a_bad_baseline_is_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"rl\.advantage\.baseline='mean': choose group_mean .* or none"):
        AdvantageConfig(baseline="mean")
    with pytest.raises(ValueError, match=r"rl\.advantage\.baseline=none .* set rl\.advantage\.estimator=grpo"):
        AdvantageConfig(baseline="none", estimator="reinforce")
    with pytest.raises(ValueError, match="baseline='median'"):
        grpo_advantages(torch.ones(4), 2, baseline="median")
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        grpo_advantages(torch.ones(4), 3, baseline="none")


def test_group_size_one_and_dynamic_sampling_with_no_baseline():
    from megatron_logra.rl.config import RLConfig

    RLConfig(group_size=1, advantage=AdvantageConfig(baseline="none"))  # a group of one trains on its reward
    with pytest.raises(ValueError, match=r"rl\.group_size=1 .* rl\.advantage\.baseline=none"):
        RLConfig(group_size=1)
    with pytest.raises(ValueError, match=r"rl\.dynamic_sampling_rounds=2 .* set rl\.group_size >= 2"):
        RLConfig(group_size=1, dynamic_sampling_rounds=2, advantage=AdvantageConfig(baseline="none"))
    RLConfig(group_size=4, dynamic_sampling_rounds=2, advantage=AdvantageConfig(baseline="none"))


def test_the_slime_flag_sets_the_field():
    from megatron_logra.config import parse_args_to_config

    cfg = parse_args_to_config("tiny", ["--disable-rewards-normalization", "--disable-grpo-std-normalization",
                                        "--n-samples-per-prompt", "1"])
    assert cfg.rl.advantage.baseline == "none" and cfg.rl.group_size == 1
    assert parse_args_to_config("tiny", []).rl.advantage.baseline == "group_mean"
    with pytest.raises(ValueError, match="rl.advantage.baseline=none"):
        parse_args_to_config("tiny", ["--disable-rewards-normalization", "rl.advantage.estimator=reinforce"])
