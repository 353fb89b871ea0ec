"""Advantage estimators (pure functions on per-sequence rewards).

* GRPO: rewards are grouped per prompt (``group_size`` samples each) and normalised by the
  group mean and standard deviation; ``scale_by_std=False`` is Dr.GRPO (mean only). ``baseline="none"``
  (slime's ``--disable-rewards-normalization``) skips the group normalisation: the raw rewards are the
  advantages, so a group of equal nonzero rewards is trained on (not zero), and only a step whose every
  reward is 0 (or, whitened, whose rewards are all equal) is one of zero advantages.
* REINFORCE with an EMA baseline (the paper's recipe): ``A = r − b`` with the baseline taken
  before this batch, then ``b ← (1 − w)·b + w·mean(r)``. Under data parallelism ``mean(r)`` is the
  mean of the whole global batch: the caller sums the rewards and their count over the DP group and
  passes them in (``rl.loop.reinforce_advantages``), so every DP rank holds the same ``b``.
* Whitening (``normalize``, slime's and verl's ``--normalize-advantages``): after either estimator the step's
  advantages become ``(A − μ) / sqrt(σ² + 1e-8)``, with ``μ`` and ``σ²`` (unbiased) over the step's *loss tokens*:
  each sequence's advantage counted once per completion token, over every DP rank (:func:`whiten_advantages`:
  one float64 all-reduce of ``[Σ n·A, Σ n·A², Σ n]``). Tokens of zero advantage (uniform GRPO groups) take part
  and come out at ``−μ / σ``, as in slime, whose mask is the loss mask alone; the groups' bookkeeping
  (``groups_uniform``, dynamic sampling) reads the rewards, before, and is unchanged. Advantages all equal
  (every group uniform) whiten to exact zeros, so such a step is still one of zero advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_logra.parallel import all_reduce_sum
from megatron_logra.rl.checks import check_finite_fields

__all__ = ["grpo_advantages", "EMABaseline", "AdvantageConfig", "BASELINES", "WHITEN_EPS", "whiten_statistics",
           "whiten_moments", "masked_whiten", "whiten_advantages"]

BASELINES = ("group_mean", "none")
"""The values of ``rl.advantage.baseline``."""

WHITEN_EPS = 1e-8
"""Added to the variance before its square root when whitening (slime's ``distributed_masked_whiten`` epsilon)."""


@dataclass
class AdvantageConfig:
    """How rewards become advantages."""

    estimator: str = "grpo"
    """grpo (group-normalised) or reinforce (EMA baseline)."""
    baseline: str = "group_mean"
    """GRPO: what each reward is measured against. ``group_mean``: its group's mean reward (then divided by the
    group's std, ``scale_by_std``); a group of equal rewards gets advantage 0. ``none``: nothing, the raw rewards
    are the advantages (slime's ``--disable-rewards-normalization``): ``scale_by_std`` and ``eps`` are not read
    (slime's ``--disable-grpo-std-normalization`` acts within that normalisation only), a group of equal rewards
    is trained on with its reward (a step is one of zero advantages only where every reward is 0), ``normalize``
    still whitens, and dynamic sampling still replaces groups of equal rewards, as slime's nonzero-std filter
    drops them whatever the normalisation. ``rl.advantage.estimator=reinforce`` subtracts its EMA baseline and
    takes ``group_mean`` only."""
    scale_by_std: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    eps: float = 1e-6
    """GRPO: added to the group std."""
    baseline_weight: float = 0.1
    """REINFORCE: EMA weight w of the batch mean reward."""
    normalize: bool = False
    """Whiten the step's advantages after the estimator (slime's / verl's ``--normalize-advantages``): subtract
    their mean and divide by their std (unbiased, + 1e-8 under the root), both over the step's loss tokens of
    every DP rank (each sequence's advantage once per completion token). Zero-advantage tokens of uniform groups
    count and move to ``−mean / std``, as in slime; advantages all equal become 0 (a step of zero advantages)."""

    def __post_init__(self) -> None:
        check_finite_fields("rl.advantage", self)  # first: nan passes the comparisons below
        if not isinstance(self.normalize, bool):
            raise ValueError(f"rl.advantage.normalize={self.normalize!r} must be true or false (whiten the step's "
                             f"advantages over its loss tokens, slime's --normalize-advantages)")
        if self.estimator not in ("grpo", "reinforce"):
            raise ValueError(f"rl.advantage.estimator={self.estimator!r}: choose grpo or reinforce")
        if self.baseline not in BASELINES:
            raise ValueError(f"rl.advantage.baseline={self.baseline!r}: choose group_mean (GRPO's group-mean "
                             f"baseline) or none (the raw rewards are the advantages, slime's "
                             f"--disable-rewards-normalization)")
        if self.baseline == "none" and self.estimator != "grpo":
            raise ValueError(f"rl.advantage.baseline=none (slime's --disable-rewards-normalization) applies to "
                             f"rl.advantage.estimator=grpo, but the estimator is {self.estimator!r}, which subtracts "
                             f"its EMA baseline: set rl.advantage.estimator=grpo or rl.advantage.baseline=group_mean")
        if not 0.0 < self.baseline_weight <= 1.0:
            raise ValueError(f"rl.advantage.baseline_weight={self.baseline_weight} must lie in (0, 1]")
        if self.eps < 0:
            raise ValueError(f"rl.advantage.eps={self.eps} must be >= 0")


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6,
                    baseline: str = "group_mean") -> torch.Tensor:
    """``[n]`` rewards laid out as consecutive groups of ``group_size`` -> ``[n]`` advantages.

    The std is the population std of the group. A group of identical rewards gets exactly 0
    whatever ``eps`` (its mean can differ from the rewards by a rounding error, which divided by
    a rounding-sized std would be ±1), so a step of uniform groups is recognised as one.
    ``baseline="none"``: the rewards themselves (a copy; ``scale_by_std`` and ``eps`` are not read).
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r}: choose one of {', '.join(BASELINES)}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if baseline == "none":
        return rewards.detach().reshape(-1).to(out_dtype).clone()
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    uniform = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    centred = torch.where(uniform, torch.zeros_like(centred), centred)
    return centred.reshape(-1).to(out_dtype)


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


def whiten_statistics(values: torch.Tensor, token_counts: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
    """float64 ``[Σ n_i·a_i, Σ n_i·a_i², Σ n_i]`` of per-sequence ``values`` ``a_i`` counted over ``token_counts``
    ``n_i`` loss tokens each. Summed over shards (a DP all-reduce) they are the whole batch's, which is why the
    whitening takes them rather than the tokens. ``n·a`` of a float32 ``a`` and ``n < 2**29`` is exact in float64,
    so equal values sum to exactly ``N·a`` in any order: their mean is ``a`` itself."""
    a = values.detach().double().reshape(-1)
    n = torch.as_tensor(token_counts, dtype=torch.float64).reshape(-1)
    if n.numel() != a.numel():
        raise ValueError(f"{a.numel()} values but {n.numel()} token counts")
    if bool((n < 0).any()):
        raise ValueError("token counts must be >= 0")
    weighted = n * a
    return torch.stack([weighted.sum(), (weighted * a).sum(), n.sum()])


def whiten_moments(stats: torch.Tensor) -> tuple[float, float, float]:
    """``(mean, variance, tokens)`` of :func:`whiten_statistics`' sums: the token-weighted mean and the unbiased
    (``N − 1``) variance, as slime's; one token has variance 0, none has mean and variance 0. The variance from
    sums of squares can round below 0 for equal values: clamped at 0."""
    total, squares, count = (float(x) for x in stats.double().reshape(-1).tolist())
    if count <= 0:
        return 0.0, 0.0, 0.0
    mean = total / count
    var = max(squares - total * mean, 0.0) / (count - 1) if count > 1 else 0.0
    return mean, var, count


def masked_whiten(values: torch.Tensor, token_counts: Union[torch.Tensor, Sequence[int]],
                  stats: Optional[torch.Tensor] = None, *, eps: float = WHITEN_EPS) -> torch.Tensor:
    """``(a − μ) / sqrt(σ² + eps)`` for every per-sequence value ``a``, in ``values``' dtype, with ``μ`` and ``σ²``
    from ``stats`` (:func:`whiten_statistics` summed over the DP group: the global batch's) or, without, from
    these values over their ``token_counts`` tokens. The mean is not added back (slime's ``shift_mean``). A
    sequence of no token, outside the statistics, gets 0 (it trains on nothing; whitened, its value could be
    arbitrarily large where the others are nearly equal, and would hide a step of zero advantages). No token at
    all: ``values`` unchanged (such a step has nothing to train on and is refused); all tokens of one value: exact
    zeros, not NaN."""
    if stats is None:
        stats = whiten_statistics(values, token_counts)
    mean, var, count = whiten_moments(stats)
    if count <= 0:
        return values.clone()
    whitened = (values.double() - mean) / math.sqrt(var + eps)
    counts = torch.as_tensor(token_counts, dtype=torch.float64, device=values.device)
    return torch.where(counts > 0, whitened, torch.zeros_like(whitened)).to(values.dtype)


def whiten_advantages(advantages: torch.Tensor, token_counts: Sequence[int],
                      dp_group: Optional[torch.distributed.ProcessGroup],
                      eps: float = WHITEN_EPS) -> tuple[torch.Tensor, Optional[float]]:
    """This DP rank's ``advantages`` whitened over the loss tokens of every rank of ``dp_group`` (one float64
    all-reduce of the sums; ``None`` or one rank: these alone), with the token-weighted std they had before
    (``None`` when the step has no loss token). Every DP rank must call; the result equals one process's on all
    ranks' sequences (up to the order of the float64 sums)."""
    stats = all_reduce_sum(whiten_statistics(advantages, token_counts), dp_group)
    _, var, count = whiten_moments(stats)
    return masked_whiten(advantages, token_counts, stats, eps=eps), (math.sqrt(var) if count > 0 else None)
