"""The degenerate cases of one RL step, named by its step number: a reward function that fails, an update
that must not be applied, a KL prediction or measurement that cannot be trusted.

* :func:`score_rollouts` scores a step's completions; a scorer that raises or returns something that is not a
  reward (a ``task.reward`` plugin's NaN, ``None``, a string, an exception, a call past
  ``task.reward_timeout_s``) stops the run with a :class:`RewardError` naming the RL step, the sample, its
  problem (source and id) and the cause, on every data-parallel rank together (a rank raising alone would
  leave the others waiting in the step's next collective). A bug in user code stops the run rather than
  reading as a wrong answer.
* :func:`refuse_update` records an update that is not applied (a non-finite loss, sketch or gradient; a step
  without a single completion token): a warning names the RL step and the cause, and after ``rl.max_bad_steps``
  such steps in a row the run stops with :class:`BadStepsError` instead of going on without training. Only
  :func:`update_applied` ends the streak (a step skipped for zero advantages neither counts nor ends it). The
  streak is not checkpointed: a resumed run starts a new one.
* :func:`trained_abs_advantage` is what decides a step of zero advantages (skipped, no update): ``Σ |A|`` over the
  rollouts with a completion token; :func:`zero_advantage_reason` says why for the log.
* :func:`kl_errors_name_step` makes a :class:`~megatron_logra.kl.controller.KLControlError` of the KL prediction
  or step size (a non-finite prediction) name the RL step; :func:`check_measured_kl` warns of a non-finite measured KL.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from megatron_logra.kl.controller import KLControlError
from megatron_logra.parallel import all_gather_bytes

logger = logging.getLogger(__name__)

__all__ = ["BadStepsError", "RewardError", "check_measured_kl", "kl_errors_name_step", "refuse_update",
           "score_rollouts", "trained_abs_advantage", "update_applied", "zero_advantage_reason"]


class RewardError(RuntimeError):
    """A reward function failed on a step's completion; the message names the RL step, sample and problem."""


class BadStepsError(RuntimeError):
    """``rl.max_bad_steps`` consecutive RL steps refused their update."""


def _describe(problem: Any) -> str:
    where = getattr(problem, "metadata", {}).get("id")
    prompt = getattr(problem, "prompt", "")
    return f"source {getattr(problem, 'source', '?')!r}" + (f", id {where!r}" if where else "") + \
        f", prompt starts {prompt[:60]!r}"


def score_rollouts(task: Any, problems: Sequence[Any], completions: Sequence[str], step: int | str,
                   dp_group: Any = None, group_size: int = 1) -> list[tuple[float, bool]]:
    """``task.score(problem, completion)`` of every completion (``problems[i]`` for completion ``i``); with reward
    worker processes (``task.reward_workers``) ``task.score_each`` of the whole batch, the same rewards and errors;
    with a reward function of a prompt's samples (``task.reward_group``) ``task.score_each`` of the batch as groups
    of ``group_size`` consecutive completions (one problem's), a failing group failing at its first sample.

    A scorer that raises (a plugin's own exception, ``ValueError`` for a value outside ``[0, 1]``, NaN,
    ``None``, a non-number, or :class:`~megatron_logra.rewards.plugins.RewardTimeout` for a plugin call past
    ``task.reward_timeout_s``, so that a hung plugin stops the run instead of leaving every other rank waiting in
    the next collective) is a :class:`RewardError` on every rank of ``dp_group`` (every DP rank must call):
    ``RL step N: the reward of sample i (source ..., id ..., prompt starts ...) failed: <cause>``, chained to
    the original exception on the rank that raised it. ``step``: the RL step, or a string naming what is scored
    instead (``"the held-out evaluation before RL step 5"``), which replaces ``RL step N`` in the message."""
    scored: list[tuple[float, bool]] = []
    error, cause = "", None
    # with reward worker processes (task.reward_workers) the batch is scored at once, concurrently
    batch = None
    if getattr(task, "scores_groups", False):  # task.reward_group: one call per problem's group_size samples
        batch = task.score_each(problems, completions, group_size)
    elif getattr(task, "pool", None) is not None:
        batch = task.score_each(problems, completions)
    for i, (problem, text) in enumerate(zip(problems, completions)):
        try:
            reward, correct = next(batch) if batch is not None else task.score(problem, text)
            reward = float(reward)
            if not math.isfinite(reward):  # Task maps scores to rewards: a non-finite one is a bug there
                raise ValueError(f"the reward {reward!r} is not finite")
        except Exception as exc:  # noqa: BLE001 - named and re-raised below, on every rank
            where = step if isinstance(step, str) else f"RL step {step}"
            error, cause = f"{where}: the reward of sample {i} ({_describe(problem)}) failed: " \
                           f"{type(exc).__name__}: {exc}", exc
            break
        scored.append((reward, bool(correct)))
    gathered = all_gather_bytes(error.encode(), dp_group)
    errors = [f"{e.decode()} (on data-parallel rank {r})" if len(gathered) > 1 else e.decode()
              for r, e in enumerate(gathered) if e]
    if errors:
        raise RewardError(errors[0]) from cause
    return scored


def refuse_update(state: Any, step: int, reason: str, limit: int) -> None:
    """Count an RL step whose update is not applied (``reason``), warn naming the step, and raise
    :class:`BadStepsError` when it is the ``limit``-th in a row (``limit`` 0: never)."""
    state.bad_streak += 1
    logger.warning("RL step %d: update not applied (%s); weights, optimizer state and engine unchanged "
                   "(%d such step(s) in a row)", step, reason, state.bad_streak)
    if limit and state.bad_streak >= limit:
        raise BadStepsError(
            f"RL step {step}: {state.bad_streak} RL steps in a row (steps without an update for zero advantages "
            f"aside) refused their update, this one for: {reason} (rl.max_bad_steps={limit}); stopping rather than "
            "training nothing. The weights are those of the last applied update: resume from the latest checkpoint "
            "with a smaller learning rate / KL budget, or look for the cause (bf16 overflow, an engine returning "
            "empty completions); rl.max_bad_steps=0 never stops")


def update_applied(state: Any) -> None:
    """An update was applied: the streak of refused ones ends."""
    state.bad_streak = 0


@contextmanager
def kl_errors_name_step(step: int) -> Iterator[None]:
    """Around the KL prediction and step size: a :class:`~megatron_logra.kl.controller.KLControlError` (a
    non-finite prediction, a probe without valid positions) is raised again naming the RL step; nothing has
    been applied yet."""
    try:
        yield
    except KLControlError as exc:
        raise KLControlError(f"RL step {step}: {exc}; the update was not applied (a controlled run never takes an "
                             "uncontrolled step). Resume from the latest checkpoint; a recurring non-finite prediction "
                             "points at overflowing logits on the probe (kl.probe, model precision)") from exc


def check_measured_kl(actual: Optional[float], step: int) -> None:
    """Warn, naming the RL step, when the KL measured after the update is not finite (``kl_actual`` is then
    ``null`` in metrics.jsonl and the calibration keeps its value): the new weights' probe logits overflow, and
    the next steps' forwards will likely be refused too."""
    if actual is not None and not math.isfinite(actual):
        logger.warning("RL step %d: the KL measured after the update is not finite (%s): the updated policy's logits "
                       "overflow on the probe; kl_actual is null and the calibration keeps its value", step, actual)


def trained_abs_advantage(advantages, rollouts) -> float:
    """``Σ |A_i|`` over the rollouts with a completion token: a step where it is 0 on every DP rank trains on nothing
    (an empty completion's advantage reaches no loss token) and is skipped as one of zero advantages."""
    return float(sum(abs(a) for a, r in zip(advantages.tolist(), rollouts) if r.completion_ids))


def zero_advantage_reason(rl) -> str:
    """Why a step's advantages are all zero, for the log line."""
    if rl.advantage.estimator != "grpo":
        return "every reward equals the baseline, or only empty completions have another"
    if rl.advantage.baseline == "none":
        return ("every reward is 0" if not rl.advantage.normalize else "all rewards equal") + \
            ", or only empty completions have another"
    return "all groups uniform, or only empty completions have a nonzero advantage"
