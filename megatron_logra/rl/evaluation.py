"""Held-out accuracy of the engine's policy (:func:`evaluate_accuracy`).

Contract: the task's held-out problems are shared over DP ranks, generated greedily by default (or
``rl.rollout.eval_samples`` samples each at ``eval_temperature``) up to ``rl.rollout.eval_max_new_tokens`` tokens
each (0: ``max_new_tokens``, as training), scored on every DP rank together (a failing or hung reward stops all of
them; with ``task.reward_group`` a problem's samples in one call), and the accuracy is all-reduced: every rank
returns the same value, or None without a held-out set.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from megatron_logra.parallel import all_reduce_sum
from megatron_logra.rl.prompts import _decode, _prompt_batch
from megatron_logra.rl.rollout_config import eval_new_tokens, new_tokens_limit
from megatron_logra.rl.sample_log import sample_records
from megatron_logra.rl.source_metrics import source_fields, source_sums
from megatron_logra.rl.step_guard import score_rollouts

if TYPE_CHECKING:
    from megatron_logra.config import RunConfig
    from megatron_logra.rewards.task import Task
    from megatron_logra.rl.loop import RLComponents

__all__ = ["evaluate_accuracy", "evaluate_held_out", "no_held_out_reason"]


def evaluate_accuracy(c: RLComponents) -> Optional[float]:
    """Held-out accuracy of the engine's policy, shared over DP ranks: greedy by default, else
    the mean over ``rl.rollout.eval_samples`` samples per problem at ``eval_temperature``. None (JSON
    ``null``) without a held-out set (``task.num_eval=0``): nothing is generated."""
    return evaluate_held_out(c)[0]


@torch.no_grad()
def evaluate_held_out(c: RLComponents, step: Optional[int] = None) -> tuple[Optional[float], dict[str, Optional[float]]]:
    """:func:`evaluate_accuracy` and its other fields: for a task mixture, the accuracy per source
    (``{"eval_accuracy/gcd": 0.4, ...}``), and with ``rl.rollout.eval_samples=k`` > 1, ``eval_pass_at_k``, the share
    of problems with at least one correct answer among their ``k`` (``eval_accuracy`` is then the mean over the ``k``,
    avg@k); ``{}`` for one source and one sample, or without a held-out set. ``step``: the RL step
    the evaluation belongs to, under which the run's sample log (``c.sample_log``) records its completions (None:
    none are recorded)."""
    from megatron_logra.rollout.engine import SamplingParams

    rollout = c.cfg.rl.rollout
    problems = c.task.eval_problems()
    if not problems:  # the same list on every rank: all of them return here, before the collective
        return None, {}
    mine = problems[c.groups.dp_rank :: c.groups.dp_size]
    k = rollout.eval_samples
    prompt_ids = _prompt_batch(c, mine, k, held_out=True)  # room for the evaluation's own cap
    completions: list[str] = []
    generated: list = []
    if mine:
        params = SamplingParams(temperature=rollout.eval_temperature, top_p=rollout.eval_top_p,
                                max_new_tokens=eval_new_tokens(rollout),
                                stop_token_ids=c.stop_token_ids(), stop=rollout.stop, seed=c.cfg.train.seed)
        generated = c.engine.generate(prompt_ids, params)
        completions = [_decode(c, r.completion_ids) for r in generated]
    asked = [p for p in mine for _ in range(k)]  # the problem of each completion
    # every DP rank scores (a rank without problems too): a failing or hung reward stops all of them together;
    # a reward function of a prompt's samples (task.reward_group) takes each problem's k completions together
    scored = score_rollouts(c.task, asked, completions, "the held-out evaluation", c.groups.dp, k)
    if step is not None and c.sample_log is not None and c.sample_log.enabled:  # the first problems' k answers
        limit = c.sample_log.limit * k
        c.sample_log.write(sample_records(step, "eval", asked, completions[:limit], generated, scored))
    correct = sum(int(ok) for _, ok in scored)
    solved = sum(any(ok for _, ok in scored[i * k:(i + 1) * k]) for i in range(len(mine)))
    counts = torch.tensor([float(correct), float(len(mine) * k), float(solved), float(len(mine))], dtype=torch.float64)
    all_reduce_sum(counts, c.groups.dp)
    by_source: dict[str, Optional[float]] = {}
    if k > 1:
        by_source["eval_pass_at_k"] = (counts[2] / counts[3]).item() if counts[3] > 0 else None
    names = c.task.eval_names
    if len(names) > 1:  # the same decision on every rank
        sums = all_reduce_sum(source_sums(names, asked, scored), c.groups.dp)
        by_source.update(source_fields(names, sums, accuracy="eval_accuracy"))
    return ((counts[0] / counts[1]).item() if counts[1] > 0 else None), by_source


def no_held_out_reason(cfg: RunConfig, task: Task) -> tuple[int, str]:
    """Why a job has no held-out set, as ``(logging level, reason naming the fix)``: none asked for
    (``task.num_eval=0``, info), every held-out prompt too long for the sequence (a warning naming
    ``model.seq_length`` and the evaluation's cap: ``rl.rollout.eval_max_new_tokens`` where set), or none of the
    sources' prompts held out (a warning naming the data and ``task.eval_modulus``)."""
    if cfg.task.num_eval == 0:
        return logging.INFO, "task.num_eval=0"
    if any(key.endswith("(held-out)") for key in task.overlong_skips):
        new_tokens, field = new_tokens_limit(cfg.rl.rollout, held_out=True)  # the evaluation's cap
        return logging.WARNING, (
            f"task.num_eval={cfg.task.num_eval}, but no held-out prompt fits model.seq_length="
            f"{cfg.model.seq_length} with {field}={new_tokens}; raise model.seq_length or lower {field}")
    if cfg.task.eval_datasets:
        return logging.WARNING, f"task.num_eval={cfg.task.num_eval}, but task.eval_datasets holds no problem"
    return logging.WARNING, (
        f"task.num_eval={cfg.task.num_eval}, but no prompt of the task's sources is held out (prompt hash % "
        f"task.eval_modulus == 0); add prompts or choose another task.eval_modulus")
