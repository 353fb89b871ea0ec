"""Advantage estimators (pure functions on per-sequence rewards).

* GRPO: rewards are grouped per prompt (``group_size`` samples each) and normalised by the
  group mean and standard deviation; ``scale_by_std=False`` is Dr.GRPO (mean only).
* REINFORCE with an EMA baseline (the paper's recipe): ``A = r − b`` with the baseline taken
  before this batch, then ``b ← (1 − w)·b + w·mean(r)``. Under data parallelism ``mean(r)`` is the
  mean of the whole global batch: the caller sums the rewards and their count over the DP group and
  passes them in (``rl.loop.reinforce_advantages``), so every DP rank holds the same ``b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.rl.checks import check_finite_fields

__all__ = ["grpo_advantages", "EMABaseline", "AdvantageConfig"]


@dataclass
class AdvantageConfig:
    """How rewards become advantages."""

    estimator: str = "grpo"
    """grpo (group-normalised) or reinforce (EMA baseline)."""
    scale_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    eps: float = 1e-6
    """GRPO: added to the group std."""
    baseline_weight: float = 0.1
    """REINFORCE: EMA weight w of the batch mean reward."""

    def __post_init__(self) -> None:
        check_finite_fields("rl.advantage", self)  # first: nan passes the comparisons below
        if self.estimator not in ("grpo", "reinforce"):
            raise ValueError(f"rl.advantage.estimator={self.estimator!r}: choose grpo or reinforce")
        if not 0.0 < self.baseline_weight <= 1.0:
            raise ValueError(f"rl.advantage.baseline_weight={self.baseline_weight} must lie in (0, 1]")
        if self.eps < 0:
            raise ValueError(f"rl.advantage.eps={self.eps} must be >= 0")


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``[n]`` rewards laid out as consecutive groups of ``group_size`` -> ``[n]`` advantages.

    The std is the population std of the group. A group of identical rewards gets exactly 0
    whatever ``eps`` (its mean can differ from the rewards by a rounding error, which divided by
    a rounding-sized std would be ±1), so a step of uniform groups is recognised as one.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    uniform = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    centred = torch.where(uniform, torch.zeros_like(centred), centred)
    return centred.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


class EMABaseline:
    """REINFORCE baseline ``b``; checkpointed with the RL state."""

    def __init__(self, weight: float = 0.1, value: float = 0.0) -> None:
        self.weight = weight
        self.value = value
        self.initialised = False

    def advantages(self, rewards: torch.Tensor, reward_sum: Optional[float] = None,
                   reward_count: Optional[int] = None) -> torch.Tensor:
        """``r − b`` with the current baseline, then fold the batch's mean reward into ``b``.

        ``rewards`` may be one shard of the batch (a data-parallel rank's): ``reward_sum`` and
        ``reward_count`` are then the sum and the number of the whole batch's rewards, the same on
        every shard, so every shard's baseline moves alike. Without them ``rewards`` is the whole
        batch (its mean, bitwise as ``reward_sum / reward_count`` of the same rewards in float64).
        The first batch initialises ``b`` to its mean (so the very first advantages are
        centred rather than measured against an arbitrary 0)."""
        if (reward_sum is None) != (reward_count is None):
            raise ValueError("pass both reward_sum and reward_count (the whole batch's), or neither")
        if reward_count is None:
            mean = float(rewards.double().mean())
        elif reward_count < 1:
            raise ValueError(f"reward_count={reward_count}: the batch has no rewards")
        else:
            mean = float(reward_sum) / int(reward_count)
        if not self.initialised:
            self.value, self.initialised = mean, True
        adv = rewards.double() - self.value
        self.value = (1.0 - self.weight) * self.value + self.weight * mean
        return adv.float()

    def state_dict(self) -> dict:
        return {"value": self.value, "initialised": self.initialised}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.initialised = bool(state["initialised"])
