"""Held-out accuracy of the engine's policy (:func:`evaluate_accuracy`).

Contract: the task's held-out problems are shared over DP ranks, generated greedily by default (or
``rl.rollout.eval_samples`` samples each at ``eval_temperature``), scored on every DP rank together (a
failing or hung reward stops all of them), and the accuracy is all-reduced: every rank returns the same
value, or None without a held-out set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megatron_logra.parallel import all_reduce_sum
from megatron_logra.rl.prompts import _decode, _prompt_batch
from megatron_logra.rl.step_guard import score_rollouts

if TYPE_CHECKING:
    from megatron_logra.rl.loop import RLComponents

__all__ = ["evaluate_accuracy"]


@torch.no_grad()
def evaluate_accuracy(c: RLComponents) -> Optional[float]:
    """Held-out accuracy of the engine's policy, shared over DP ranks: greedy by default, else
    the mean over ``rl.rollout.eval_samples`` samples per problem at ``eval_temperature``. None (JSON
    ``null``) without a held-out set (``task.num_eval=0``): nothing is generated."""
    from megatron_logra.rollout.engine import SamplingParams

    rollout = c.cfg.rl.rollout
    problems = c.task.eval_problems()
    if not problems:  # the same list on every rank: all of them return here, before the collective
        return None
    mine = problems[c.groups.dp_rank :: c.groups.dp_size]
    k = rollout.eval_samples
    prompt_ids = _prompt_batch(c, mine, k)
    completions: list[str] = []
    if mine:
        params = SamplingParams(temperature=rollout.eval_temperature, top_p=1.0, max_new_tokens=rollout.max_new_tokens,
                                stop_token_ids=c.stop_token_ids(), seed=c.cfg.train.seed)
        completions = [_decode(c, r.completion_ids) for r in c.engine.generate(prompt_ids, params)]
    # every DP rank scores (a rank without problems too): a failing or hung reward stops all of them together
    scored = score_rollouts(c.task, [p for p in mine for _ in range(k)], completions, "the held-out evaluation",
                            c.groups.dp)
    correct = sum(int(ok) for _, ok in scored)
    counts = torch.tensor([float(correct), float(len(mine) * rollout.eval_samples)], dtype=torch.float64)
    all_reduce_sum(counts, c.groups.dp)
    return (counts[0] / counts[1]).item() if counts[1] > 0 else None
