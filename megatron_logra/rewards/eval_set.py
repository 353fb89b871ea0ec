"""The held-out eval set of a :class:`~megatron_logra.rewards.task.Task` (the :class:`HeldOutSet` mixin).

Contract
--------
* **Eval set** — ``num_eval`` distinct prompts split over sources by weight (largest
  remainder, :func:`allocate_counts`), drawn from the eval sources (seeded by ``eval_seed``) in a fixed
  order; a source whose eval-only prompt space is exhausted contributes fewer (logged as a warning).
  Computed once and cached. Only eval-only prompts (``is_eval_prompt``) that pass the task's prompt filter
  are taken, so the set is disjoint from every train prompt.
* **Benchmarks** (``task.eval_datasets``) — when the host has ``benchmarks``, the held-out set is theirs instead:
  up to ``num_eval`` problems of each, a file's rows in file order (a file cut short is warned of), a generated
  dataset's first distinct prompts in its seeded order; prompts the filter refuses are skipped. ``num_eval=0``
  holds out none (evaluation is off; one warning says so and that training may then use the benchmarks' prompts).
  :meth:`HeldOutSet.held_out_prompts` (the texts of those problems, before the filter, whitespace normalised) is
  what the train stream then skips, so that train and held-out stay disjoint by prompt text.
* The host class provides ``eval_sources``, ``benchmarks``, ``eval_seed``, ``eval_modulus``, ``num_eval``,
  ``weights``, ``names``, ``_eval`` and ``_held_out`` (the caches, None until drawn; ``_held_out_prompts`` is
  set with ``_held_out``), ``is_eval_prompt``, ``_passes`` (the prompt filter) and ``held_out_limit`` (the field
  of the cap the held-out prompts leave room for, which a warning names).
"""

from __future__ import annotations

import logging
import math
import random
from typing import Iterator, Sequence

from megatron_logra.rewards.base import Problem, same_prompt_key, stable_hash

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

    def _eval_candidates(self, source) -> Iterator[int]:
        """Raw indices of ``source`` in the held-out set's seeded order."""
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
        for raw in self._eval_candidates(source):
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
                   f"{self.held_out_limit})" if refused else
                   "its prompt space is small (a smaller task.eval_modulus holds out more of it)")
            logger.warning("%s: only %d distinct eval-only prompts found (asked for %d, scanned %d candidates); %s",
                           source.name, len(out), count, scanned, why)
        return out

    def _benchmark_problems(self, source) -> list[Problem]:
        """Up to ``num_eval`` problems of a benchmark, before the prompt filter (see the module doc)."""
        if self.num_eval == 0:  # evaluation off: nothing held out (benchmark_problems says so once)
            return []
        rows = getattr(source, "problems", None)
        if rows is not None:  # a file: its rows in file order
            if len(rows) > self.num_eval:
                logger.warning("%s: evaluating its first %d of %d rows (task.num_eval=%d per task.eval_datasets "
                               "entry; raise it to evaluate them all)", source.name, self.num_eval, len(rows),
                               self.num_eval)
            return list(rows[: self.num_eval])
        out: list[Problem] = []
        seen: set[str] = set()
        misses = 0
        for raw in self._eval_candidates(source):
            if len(out) >= self.num_eval or misses >= EVAL_PATIENCE:
                break
            problem = source.problem(raw)
            if problem.prompt in seen:
                misses += 1
                continue
            misses = 0
            seen.add(problem.prompt)
            out.append(problem)
        return out

    def benchmark_problems(self) -> list[Problem]:
        """The benchmarks' held-out problems before the prompt filter (cached; a new list each call; empty without
        benchmarks)."""
        if self._held_out is None:
            if self.benchmarks and self.num_eval == 0:
                logger.warning("task.num_eval=0: held-out evaluation is off, so task.eval_datasets %s are not "
                               "evaluated and none of their prompts is kept out of training; give task.num_eval=N to "
                               "evaluate up to N problems of each (and never train on them)", self.eval_names)
            self._held_out = [p for source in self.benchmarks for p in self._benchmark_problems(source)]
            self._held_out_prompts = frozenset(same_prompt_key(p.prompt) for p in self._held_out)
        return list(self._held_out)

    def held_out_prompts(self) -> frozenset[str]:
        """The prompt texts of :meth:`benchmark_problems` with their whitespace normalised
        (:func:`~megatron_logra.rewards.base.same_prompt_key`): the train stream skips a prompt whose normalised
        text is one of them."""
        self.benchmark_problems()
        return self._held_out_prompts

    def is_held_out(self, prompt: str) -> bool:
        """Whether ``prompt`` is one of :meth:`held_out_prompts` once its whitespace is normalised: a training row
        ``"What is 2+2? "`` is the benchmark's ``"What is  2+2?"``."""
        return same_prompt_key(prompt) in self.held_out_prompts()

    def eval_problems(self) -> list[Problem]:
        """The held-out problems (cached; a new list each call), disjoint from every train prompt."""
        if self._eval is None and self.benchmarks:
            by_name = {source.name: source for source in self.benchmarks}
            problems = [p for p in self.benchmark_problems() if self._passes(by_name[p.source], p, "held-out")]
            self._eval = problems
            logger.info("eval set: %d problems over %s", len(problems),
                        {name: sum(p.source == name for p in problems) for name in self.eval_names})
        if self._eval is None:
            counts = allocate_counts(self.num_eval, self.weights)
            problems: list[Problem] = []
            for k, count in enumerate(counts):
                if count:
                    problems.extend(self._eval_for_source(k, count))
            self._eval = problems
            logger.info("eval set: %d problems over %s", len(problems), dict(zip(self.names, counts)))
        return list(self._eval)
