"""The train stream of a :class:`~megatron_logra.rewards.task.Task` (the :class:`TrainStream` mixin).

Contract
--------
* ``train_problem(index)`` is a pure function of ``(seed, index)`` (and the sources' configuration and the
  prompt filter): :meth:`TrainStream.source_index` picks the source with probability proportional to its
  weight by ``unit_uniform(seed, "mix", index)``, then raw indices ``stable_hash(seed, "train", source, index,
  attempt) % size`` are tried for ``attempt = 0, 1, ...`` until one is trainable (not eval-only, passes the
  prompt filter). After :data:`MAX_TRAIN_ATTEMPTS` misses (:data:`MAX_FILTERED_ATTEMPTS` with a filter), a
  finite source of at most :data:`SCAN_LIMIT` prompts is scanned in full from a hashed start; a source with no
  trainable prompt is a ValueError naming it and the fix, which :meth:`TrainStream.check_trainable` raises at
  start.
* The host class provides ``sources``, ``weights``, ``_cum`` (their running sums), ``seed``, ``eval_modulus``,
  ``benchmarks``, ``eval_names``, ``_fits`` (the prompt filter, or None), ``_why`` (why a prompt does not fit),
  ``is_eval_prompt``, ``_trainable`` (not eval-only, passes the filter; counts a refused prompt) and ``_fix`` (what
  keeps the prompts the filter refuses, or empty for the model's room: raise ``model.seq_length`` or lower
  ``rl.rollout.max_new_tokens``).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterator

from megatron_logra.rewards.base import Problem, ProblemSource, stable_hash, unit_uniform
from megatron_logra.rewards.jsonl import file_spec_path

__all__ = ["CHECK_DRAWS", "MAX_FILTERED_ATTEMPTS", "MAX_TRAIN_ATTEMPTS", "SCAN_LIMIT", "TrainStream"]

MAX_TRAIN_ATTEMPTS = 64
"""Raw indices tried per train index before giving up (each is eval-only with probability ≈ 1/eval_modulus)."""

MAX_FILTERED_ATTEMPTS = 1024
"""Raw indices tried per train index with a prompt filter installed: a source whose prompts mostly fail it
(95% over-long, say) still serves every index (0.95**1024 ≈ 1e-23), rather than failing one mid-run."""

SCAN_LIMIT = 4096
"""Finite sources up to this size are scanned in full before a train index gives up: such a source
yields a training problem for every index as long as one of its prompts is not eval-only."""

CHECK_DRAWS = 8
"""Train indices :meth:`TrainStream.check_trainable` draws from each source of positive weight."""


class TrainStream:
    """The deterministic train stream of a task over weighted sources (a mixin; see the module doc for what
    the host provides)."""

    def source_index(self, index: int) -> int:
        """Which source train ``index`` draws from (weighted, a pure function of ``(seed, index)``)."""
        if len(self.sources) == 1:
            return 0
        u = unit_uniform(self.seed, "mix", index) * self._cum[-1]
        k = bisect_right(self._cum, u)  # first k with cum[k] > u: never a zero-weight source
        if k >= len(self.sources):  # u rounded up to the total: take the last positive weight
            k = max(i for i, w in enumerate(self.weights) if w > 0)
        return k

    def train_problem(self, index: int) -> Problem:
        """Training problem number ``index`` (>= 0) of the infinite, deterministic stream; never eval-only."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"train index must be an int >= 0, got {index!r}")
        return self._draw(self.sources[self.source_index(index)], index)

    def _candidates(self, source: ProblemSource, index: int, attempts: int) -> Iterator[int]:
        """Raw indices train ``index`` tries in order: ``attempts`` hashed ones, then a small source in full."""
        size = source.size
        for attempt in range(attempts):
            raw = stable_hash(self.seed, "train", source.name, index, attempt)
            yield raw % size if size else raw
        if size is not None and size <= SCAN_LIMIT:  # a small space: look at every prompt before giving up
            start = stable_hash(self.seed, "train-scan", source.name, index) % size
            yield from ((start + offset) % size for offset in range(size))

    def _draw(self, source: ProblemSource, index: int) -> Problem:
        """The first trainable problem of ``source`` for train ``index`` (see the module doc)."""
        attempts = MAX_TRAIN_ATTEMPTS if self._fits is None else MAX_FILTERED_ATTEMPTS
        long_prompt: str | None = None  # the last prompt the filter refused
        for raw in self._candidates(source, index, attempts):
            problem = source.problem(raw)
            if self._trainable(source, problem):
                return problem
            if not self.is_eval_prompt(problem.prompt):
                long_prompt = problem.prompt
        size = source.size
        if size is not None and size <= SCAN_LIMIT:
            tried = f"all {size} of its prompts are {{}}"
        else:
            tried = f"it produced only {{}} prompts in {attempts} draws (train index {index})"
        jsonl = file_spec_path(source.name) is not None  # a file of the user's
        if long_prompt is not None:
            fix = ("shorten the file's prompts" if jsonl
                   else f"make its prompts shorter via task.dataset_kwargs[{source.name!r}]")
            # the filter's own fix where it has one (task.max_prompt_tokens: the model's room is not what refuses)
            limit = getattr(self, "_fix", "") or "raise model.seq_length, lower rl.rollout.max_new_tokens"
            raise ValueError(
                f"task.datasets: {source.name!r} has no training prompts that fit: "
                f"{tried.format('eval-only or over-long')}; the last one: {self._why(long_prompt)} — {limit} "
                f"or {fix}")
        what = tried.format("eval-only")
        if self.benchmarks:
            raise ValueError(
                f"task.datasets: {source.name!r} has no training prompts: {what} (prompts of the held-out problems of "
                f"task.eval_datasets {self.eval_names}, which training skips); train on other data than the "
                f"benchmark, or lower task.num_eval")
        fix = ("add rows to the file or choose another task.eval_modulus" if jsonl
               else f"enlarge it via task.dataset_kwargs[{source.name!r}] or choose another task.eval_modulus")
        raise ValueError(
            f"task.datasets: {source.name!r} has no training prompts: {what} (prompt hash % "
            f"task.eval_modulus={self.eval_modulus} == 0, whatever task.num_eval); its prompt space is too small "
            f"to split — {fix}"
        )

    def check_trainable(self) -> None:
        """ValueError naming the source when a source of positive weight yields no training prompt.

        Draws the first :data:`CHECK_DRAWS` train indices' problems from each such source; with
        :data:`SCAN_LIMIT` covering small finite sources, a source that passes can serve every train
        index, so a run fails here, at start, rather than mid-training. With a prompt filter installed, a
        source whose draws are all over-long is refused here too, and one that yields some over-long
        prompts most likely logs its warning here.
        """
        for source, weight in zip(self.sources, self.weights):
            if weight > 0:
                for index in range(CHECK_DRAWS):
                    self._draw(source, index)
