"""The rollout and reward stages of an RL step (:func:`collect_groups`): dynamic sampling, over-long penalty.

Contract: every DP rank returns exactly ``rl.prompts_per_step / DP`` groups of ``rl.group_size`` rollouts with
their rewards. Without dynamic sampling (``rl.dynamic_sampling_rounds=0``) these are the groups of the step's
prompts: train indices ``(step - 1) * P + dp_rank * P/DP + i`` of the task's stream, as always.

With ``rl.dynamic_sampling_rounds=R`` (DAPO's dynamic sampling), a group whose rewards are all equal (GRPO
advantage 0: it adds nothing to the gradient) is *uniform*. While any DP rank's batch holds one and rounds are
left, every DP rank samples one more round of ``P/DP`` fresh prompts (all ranks together, so that engines and
the reward's collectives stay in step) and replaces its uniform groups, in order, by that round's informative
groups, in order. Extra rounds draw from indices ``RESAMPLE_OFFSET + ((step - 1) * R + round - 1) * P +
dp_rank * P/DP + i``: disjoint from the training stream and a pure function of (step, round, rank), so a
resumed run draws the same prompts. Uniform groups left after ``R`` rounds stay (advantage 0).

With ``rl.overlong_buffer`` > 0 every reward first loses DAPO's soft over-long penalty
(:func:`overlong_penalty`), so that a group whose samples differ only in length is informative too.

Statistics of what was *generated* (every round: reward sum, correct count, rollouts, completion tokens)
are returned apart from the kept batch's: they estimate the policy without the selection's bias toward
prompts of mixed outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_logra.parallel import all_reduce_sum
from megatron_logra.rl.batch_layout import share_per_rank
from megatron_logra.rl.prompts import _decode, _prompt_batch
from megatron_logra.rl.source_metrics import source_sums
from megatron_logra.rl.step_guard import score_rollouts

if TYPE_CHECKING:
    from megatron_logra.rl.loop import RLComponents
    from megatron_logra.profiling import Phases
    from megatron_logra.rollout.engine import Rollout

__all__ = ["RESAMPLE_OFFSET", "StepGroups", "collect_groups", "overlong_penalty"]

RESAMPLE_OFFSET = 1 << 48
"""First train index of the extra rounds' prompts (far past any index the training stream reaches)."""


@dataclass
class StepGroups:
    """This DP rank's groups for one RL step (see the module doc)."""

    problems: list[Any]
    """One problem per group."""
    rollouts: list[Rollout]
    """``group_size`` rollouts per problem, group after group."""
    rewards_N: torch.Tensor
    """float64 reward of every rollout: the task's Python floats exactly, so that what is logged (``samples.jsonl``)
    is the reward the task gave (float32 would log -0.005 as -0.004999999888); the advantages are computed from
    their float32 values, as before they were logged exactly."""
    correct_N: torch.Tensor
    """1.0 where the rollout's answer is correct."""
    generated_4: torch.Tensor
    """float64 ``[reward sum, correct count, rollouts, completion tokens]`` over every rollout this rank
    generated in the step (all rounds)."""
    prompts_skipped: int
    """Training prompts the prompt filter refused while this rank drew the step's prompts (all rounds)."""
    extra_rounds: int
    """Rounds of dynamic sampling run after the first (the same on every rank)."""
    replaced: int
    """Uniform groups this rank replaced by informative ones."""
    uniform: int
    """Uniform groups left in this rank's batch."""
    passed: int
    """Groups of this rank's batch with a correct rollout (slime's pass@n, n = ``group_size``, is their share)."""
    generate_seconds: float
    """Time spent in the engine's ``generate`` (all rounds)."""
    by_source_S3: torch.Tensor
    """float64 ``[num_sources, 3]``: reward sum, correct count and rollouts per task source, over every rollout
    this rank generated (:func:`~megatron_logra.rl.source_metrics.source_sums`)."""


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft over-long punishment of a completion of ``length`` tokens: 0 up to ``max_new_tokens − buffer``
    tokens, then ``penalty`` × the fraction of the ``buffer`` it uses, ``penalty`` at ``max_new_tokens`` and
    beyond (``buffer`` 0: no penalty)."""
    if buffer <= 0:
        return 0.0
    return penalty * min(1.0, max(0, length - (max_new_tokens - buffer)) / buffer)


def _sample_round(c: RLComponents, step: int, first: int, count: int, round_: int, ph: Phases | None
                  ) -> tuple[list[Any], list[Rollout], list[tuple[float, bool]], int, float]:
    """Problems ``first .. first + count - 1`` of the task, ``group_size`` rollouts each, scored (every DP rank
    together). Returns problems, rollouts, scores, prompts skipped by the filter and the generate time."""
    from megatron_logra.rollout.engine import SamplingParams

    cfg, rl, groups = c.cfg, c.cfg.rl, c.groups
    if ph is not None:
        ph.next("rollout")
    skips_before = sum(getattr(c.task, "overlong_skips", {}).values())
    problems = [c.task.train_problem(first + i) for i in range(count)]
    skipped = sum(getattr(c.task, "overlong_skips", {}).values()) - skips_before
    prompt_ids = _prompt_batch(c, problems, rl.group_size, step)
    seed = cfg.train.seed * 1_000_003 + step * 1009 + groups.dp_rank
    params = SamplingParams(temperature=rl.rollout.temperature, top_p=rl.rollout.top_p,
                            max_new_tokens=rl.rollout.max_new_tokens, stop_token_ids=c.stop_token_ids(),
                            stop=rl.rollout.stop, seed=seed ^ (round_ << 40))
    t0 = time.perf_counter()
    rollouts = c.engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - t0
    if ph is not None:
        ph.next("reward")
    scored = score_rollouts(c.task, [p for p in problems for _ in range(rl.group_size)],
                            [_decode(c, r.completion_ids) for r in rollouts], step, groups.dp, rl.group_size)
    if rl.overlong_buffer:
        scored = [(reward - overlong_penalty(len(r.completion_ids), rl.rollout.max_new_tokens, rl.overlong_buffer,
                                             rl.overlong_penalty), correct)
                  for (reward, correct), r in zip(scored, rollouts)]
    return problems, rollouts, scored, skipped, seconds


def _generated(rollouts: list[Rollout], scored: list[tuple[float, bool]]) -> torch.Tensor:
    return torch.tensor([sum(s[0] for s in scored), float(sum(s[1] for s in scored)), float(len(rollouts)),
                         float(sum(len(r.completion_ids) for r in rollouts))], dtype=torch.float64)


def _is_uniform(group: tuple) -> bool:
    """All rewards of the group equal, as :func:`~megatron_logra.rl.advantages.grpo_advantages` decides it (on
    the float32 rewards)."""
    rewards = torch.tensor([s[0] for s in group[2]], dtype=torch.float32)
    return bool(rewards.amax() == rewards.amin())


def collect_groups(c: RLComponents, step: int, ph: Phases | None = None) -> StepGroups:
    """This DP rank's groups for RL step ``step`` (1-based), with dynamic sampling when
    ``rl.dynamic_sampling_rounds`` > 0 (see the module doc). Every DP rank must call."""
    rl, groups, names = c.cfg.rl, c.groups, c.task.names
    size, rounds = rl.group_size, rl.dynamic_sampling_rounds
    per_rank = share_per_rank("rl.prompts_per_step", rl.prompts_per_step, groups.dp_size, "prompts")
    generated = torch.zeros(4, dtype=torch.float64)
    by_source = torch.zeros(len(names), 3, dtype=torch.float64)
    totals = {"skipped": 0, "seconds": 0.0}

    def sample(first: int, round_: int) -> list[tuple]:
        """One round's groups, as (problem, its rollouts, their scores); everything generated is tallied."""
        problems, rollouts, scored, skipped, seconds = _sample_round(c, step, first, per_rank, round_, ph)
        totals["skipped"] += skipped
        totals["seconds"] += seconds
        generated.add_(_generated(rollouts, scored))
        by_source.add_(source_sums(names, [p for p in problems for _ in range(size)], scored))
        return [(p, rollouts[i * size:(i + 1) * size], scored[i * size:(i + 1) * size]) for i, p in enumerate(problems)]

    batch = sample((step - 1) * rl.prompts_per_step + groups.dp_rank * per_rank, 0)
    extra = replaced = 0
    for round_ in range(1, rounds + 1):
        short = torch.tensor([float(sum(_is_uniform(g) for g in batch))], dtype=torch.float64)
        if all_reduce_sum(short, groups.dp).item() == 0:  # the same decision on every rank
            break
        extra += 1
        first = RESAMPLE_OFFSET + ((step - 1) * rounds + round_ - 1) * rl.prompts_per_step + groups.dp_rank * per_rank
        fresh = iter([g for g in sample(first, round_) if not _is_uniform(g)])
        for k, group in enumerate(batch):
            if _is_uniform(group):
                informative = next(fresh, None)
                if informative is None:
                    break
                batch[k] = informative
                replaced += 1
    kept_scores = [s for g in batch for s in g[2]]
    return StepGroups(
        problems=[g[0] for g in batch], rollouts=[r for g in batch for r in g[1]],
        rewards_N=torch.tensor([s[0] for s in kept_scores], dtype=torch.float64),
        correct_N=torch.tensor([float(s[1]) for s in kept_scores]),
        generated_4=generated, prompts_skipped=totals["skipped"], extra_rounds=extra, replaced=replaced,
        uniform=sum(_is_uniform(g) for g in batch), passed=sum(any(s[1] for s in g[2]) for g in batch),
        generate_seconds=totals["seconds"], by_source_S3=by_source,
    )
