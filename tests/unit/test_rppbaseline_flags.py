"""slime's ``--advantage-estimator reinforce_plus_plus_baseline`` (REINFORCE++ with a group baseline): the group's mean
reward subtracted without the std division, then the advantages whitened over the step's loss tokens
(``--normalize-advantages``, which slime requires with it); the pieces against a hand-computed reference, and the
lines slime refuses refused here."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.advantages import grpo_advantages, whiten_advantages


def test_the_flag_sets_the_group_mean_and_needs_the_whitening():
    cfg = parse_args_to_config("tiny", ["--advantage-estimator", "reinforce_plus_plus_baseline",
                                        "--normalize-advantages"])
    adv = cfg.rl.advantage
    assert (adv.estimator, adv.baseline, adv.scale_by_std, adv.normalize) == ("grpo", "group_mean", False, True)
    cfg = parse_args_to_config("tiny", ["--normalize-advantages", "--disable-grpo-std-normalization",
                                        "--advantage-estimator", "reinforce_plus_plus_baseline"])
    assert (cfg.rl.advantage.scale_by_std, cfg.rl.advantage.normalize) == (False, True)


@pytest.mark.parametrize("extra, match", [
    ([], "give --normalize-advantages"),
    (["--normalize-advantages", "--disable-rewards-normalization"], "drop one of them"),
])
def test_lines_slime_refuses_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        parse_args_to_config("tiny", ["--advantage-estimator", "reinforce_plus_plus_baseline", *extra])


def test_other_estimators_are_still_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline .*reinforce_plus_plus \\(discounted returns\\)"):
        parse_args_to_config("tiny", ["--advantage-estimator", "reinforce_plus_plus"])


def test_the_advantages_are_the_group_mean_removed_then_whitened_over_tokens():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # two groups of four
    tokens = [3, 5, 1, 4, 2, 2, 6, 1]
    centred = grpo_advantages(rewards, 4, scale_by_std=False)
    whitened, std = whiten_advantages(centred, tokens, None)
    # by hand: group means 0.5 and 0.75; each sample's advantage repeated over its tokens, then whitened
    raw = [r - (0.5 if i < 4 else 0.75) for i, r in enumerate(rewards.tolist())]
    per_token = [a for a, n in zip(raw, tokens) for _ in range(n)]
    mean = sum(per_token) / len(per_token)
    var = sum((a - mean) ** 2 for a in per_token) / (len(per_token) - 1)
    assert centred.tolist() == pytest.approx(raw)
    assert std == pytest.approx(math.sqrt(var))
    assert whitened.tolist() == pytest.approx([(a - mean) / math.sqrt(var + 1e-8) for a in raw], rel=1e-5)
