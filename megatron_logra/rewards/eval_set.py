"""The held-out eval set of a :class:`~megatron_logra.rewards.task.Task` (the :class:`HeldOutSet` mixin).

Contract
--------
* **Eval set** — ``num_eval`` distinct prompts split over sources by weight (largest
  remainder, :func:`allocate_counts`), drawn from the eval sources (seeded by ``eval_seed``) in a fixed
  order; a source whose eval-only prompt space is exhausted contributes fewer (logged as a warning).
  Computed once and cached. Only eval-only prompts (``is_eval_prompt``) that pass the task's prompt filter
  are taken, so the set is disjoint from every train prompt.
* The host class provides ``eval_sources``, ``eval_seed``, ``eval_modulus``, ``num_eval``, ``weights``,
  ``names``, ``_eval`` (the cache, None until drawn), ``is_eval_prompt`` and ``_passes`` (the prompt filter).
"""

from __future__ import annotations

import logging
import math
import random
from typing import Iterator, Sequence

from megatron_logra.rewards.base import Problem, stable_hash

__all__ = ["HeldOutSet", "allocate_counts"]

logger = logging.getLogger(__name__)

EVAL_PATIENCE = 2000
"""Stop scanning a source for eval prompts after this many consecutive candidates gave no new one."""

ENUMERATE_LIMIT = 1_000_000
"""Finite sources up to this size are scanned as a seeded permutation of all their raw indices."""


def allocate_counts(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder; ties to the first)."""
    wsum = float(sum(weights))
    if total <= 0 or wsum <= 0:
        return [0] * len(weights)
    exact = [total * w / wsum for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class HeldOutSet:
    """The held-out problems of a task over weighted sources (a mixin; see the module doc for what the host
    provides)."""

    def _eval_candidates(self, k: int) -> Iterator[int]:
        source = self.eval_sources[k]
        size = source.size
        if size is not None and size <= ENUMERATE_LIMIT:
            order = list(range(size))
            random.Random(stable_hash(self.eval_seed, "eval-order", source.name)).shuffle(order)
            yield from order
            return
        j = 0
        while True:
            raw = stable_hash(self.eval_seed, "eval", source.name, j)
            yield raw % size if size else raw
            j += 1

    def _eval_for_source(self, k: int, count: int) -> list[Problem]:
        source = self.eval_sources[k]
        max_scan = max(10_000, 50 * self.eval_modulus * count)
        seen: set[str] = set()
        out: list[Problem] = []
        misses = scanned = refused = 0
        for raw in self._eval_candidates(k):
            if len(out) >= count or misses >= EVAL_PATIENCE or scanned >= max_scan:
                break
            scanned += 1
            problem = source.problem(raw)
            if problem.prompt in seen or not self.is_eval_prompt(problem.prompt):
                misses += 1
                continue
            if not self._passes(source, problem, "held-out"):
                seen.add(problem.prompt)
                misses += 1
                refused += 1
                continue
            misses = 0
            seen.add(problem.prompt)
            out.append(problem)
        if len(out) < count:
            why = (f"{refused} distinct eval-only prompts do not fit the sequence (raise model.seq_length or lower "
                   f"rl.rollout.max_new_tokens)" if refused else
                   "its prompt space is small (a smaller task.eval_modulus holds out more of it)")
            logger.warning("%s: only %d distinct eval-only prompts found (asked for %d, scanned %d candidates); %s",
                           source.name, len(out), count, scanned, why)
        return out

    def eval_problems(self) -> list[Problem]:
        """The held-out problems (cached; a new list each call), disjoint from every train prompt."""
        if self._eval is None:
            counts = allocate_counts(self.num_eval, self.weights)
            problems: list[Problem] = []
            for k, count in enumerate(counts):
                if count:
                    problems.extend(self._eval_for_source(k, count))
            self._eval = problems
            logger.info("eval set: %d problems over %s", len(problems), dict(zip(self.names, counts)))
        return list(self._eval)
