"""A training task: a weighted mixture of problem sources, a held-out eval set and reward mapping.

Contracts
---------
* **Train stream** — ``train_problem(index)`` is a pure function of ``(seed, index)`` (and the
  sources' configuration): the source is picked with probability proportional to its weight by
  ``unit_uniform(seed, "mix", index)``, then raw indices ``stable_hash(seed, "train", source,
  index, attempt) % size`` are tried for ``attempt = 0, 1, ...`` until the prompt is not eval-only
  and passes the prompt filter, if any (``set_prompt_filter``; the RL job's: "fits the room
  ``model.seq_length`` leaves for ``rl.rollout.max_new_tokens``"; the held-out set's may be one of its own, for
  ``rl.rollout.eval_max_new_tokens``; refused prompts are counted in ``overlong_skips``, one warning per
  source). After ``MAX_TRAIN_ATTEMPTS`` misses (``MAX_FILTERED_ATTEMPTS`` with a filter), a finite source
  of at most ``SCAN_LIMIT`` prompts is scanned in full from a hashed start; a source with no trainable
  prompt is a ValueError (eval-only or over-long), which ``check_trainable`` raises at start. A pure
  function of ``(seed, index)`` and the filter (a function of the prompt text): any process (any DP rank)
  computes the same problem for the same index; indices need not be visited in order. Sources are sampled
  with replacement.
* **Held-out set** — a prompt is eval-only iff ``prompt_bucket(prompt, eval_modulus) == 0``
  (a blake2b hash of the prompt text). The train stream never returns such a prompt, and
  ``eval_problems()`` returns only such prompts, so the two are disjoint *by prompt text*, for
  every source, seed and index — including tiny prompt spaces (1-digit ``chain_sum``) where any
  fresh sample would repeat training prompts. (A different reasoning-gym seed alone is not a
  split: most datasets draw item ``i`` from ``Random(seed + i)``.) About ``1/eval_modulus`` of
  each prompt space is reserved for evaluation.
* **Eval set** — ``num_eval`` distinct prompts split over sources by weight, drawn once and cached
  (:mod:`megatron_logra.rewards.eval_set`).
* **Benchmarks** — with ``benchmarks`` (``task.eval_datasets``: held-out sources of their own) the held-out set
  is theirs, and a prompt is eval-only iff it is the prompt of one of their held-out problems (by text, blanks
  normalised): the train stream then uses every other prompt of its sources, and the two stay disjoint.
* **Rewards** — ``score`` returns ``(reward, correct)``: ``correct = score >= 1`` and
  ``reward = correct_reward`` if correct else ``wrong_reward + score * (correct_reward - wrong_reward)``
  (or plain ``wrong_reward`` when ``graded=False``). A scorer whose ``raw_rewards`` is true (a slime reward
  function, ``task.reward=slime:...``: :mod:`megatron_logra.rewards.slime_rm`) returns the reward itself, any finite
  number: ``reward = score`` and ``correct = reward >= correct_reward``, as slime uses its function's float and the
  correct reward is what a correct answer earns. ``score_each`` scores a batch, in worker processes when the
  task has a pool (``task.reward_workers``: the same rewards; :mod:`megatron_logra.rewards.process_pool`), with
  ``task.reward_group`` one call per problem's ``group_size`` samples.
"""

from __future__ import annotations

import logging
import math
from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional, Sequence

from megatron_logra.rewards.base import Problem, ProblemSource, PromptFilter, Scorer, prompt_bucket
from megatron_logra.rewards.eval_set import HeldOutSet, allocate_counts
from megatron_logra.rewards.train_stream import MAX_FILTERED_ATTEMPTS, MAX_TRAIN_ATTEMPTS, SCAN_LIMIT, TrainStream

if TYPE_CHECKING:
    from megatron_logra.rewards.process_pool import RewardProcessPool

__all__ = ["MAX_FILTERED_ATTEMPTS", "MAX_TRAIN_ATTEMPTS", "SCAN_LIMIT", "Task", "allocate_counts"]

logger = logging.getLogger(__name__)


class Task(TrainStream, HeldOutSet):
    """Train stream, held-out eval set and reward mapping over weighted problem sources."""

    def __init__(
        self,
        sources: Sequence[ProblemSource],
        scorers: Mapping[str, Scorer],
        weights: Sequence[float] | None = None,
        *,
        eval_sources: Sequence[ProblemSource] | None = None,
        benchmarks: Sequence[ProblemSource] | None = None,
        seed: int = 0,
        eval_seed: int = 1,
        num_eval: int = 200,
        eval_modulus: int = 16,
        correct_reward: float = 1.0,
        wrong_reward: float = -0.01,
        graded: bool = True,
        pool: Optional[RewardProcessPool] = None,
    ) -> None:
        if not sources:
            raise ValueError("task.datasets: at least one problem source is required")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"task.datasets: duplicate sources {names}")
        weights = list(weights) if weights else [1.0] * len(sources)
        if len(weights) != len(sources) or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"task.weights={weights}: need {len(sources)} finite weights >= 0 with a positive sum")
        eval_sources = list(eval_sources) if eval_sources is not None else list(sources)
        if [s.name for s in eval_sources] != names:
            raise ValueError("eval_sources must match sources one to one (same names, same order)")
        self.benchmarks = list(benchmarks or [])
        """Held-out sources of their own (``task.eval_datasets``); empty: the held-out set is split from ``sources``
        by ``eval_modulus``."""
        bench_names = [s.name for s in self.benchmarks]
        if len(set(bench_names)) != len(bench_names):
            raise ValueError(f"task.eval_datasets: duplicate sources {bench_names}")
        missing = [n for n in dict.fromkeys(names + bench_names) if n not in scorers]
        if missing:
            raise ValueError(f"task.reward: no scorer for sources {missing}")
        if eval_modulus < 2:
            raise ValueError(f"task.eval_modulus={eval_modulus} must be >= 2")
        if not correct_reward > wrong_reward:
            raise ValueError(f"task.correct_reward={correct_reward} must exceed task.wrong_reward={wrong_reward}")
        self.sources = list(sources)
        self.eval_sources = eval_sources
        self.scorers = dict(scorers)
        self.weights = [float(w) for w in weights]
        self._cum = list(accumulate(self.weights))
        self.seed = seed
        self.eval_seed = eval_seed
        self.num_eval = num_eval
        self.eval_modulus = eval_modulus
        self.correct_reward = float(correct_reward)
        self.wrong_reward = float(wrong_reward)
        self.graded = bool(graded)
        self.pool = pool
        """Worker processes that score in place of this process (``task.reward_workers``), or None."""
        self._eval: list[Problem] | None = None
        self._held_out: list[Problem] | None = None
        self._held_out_prompts: frozenset[str] = frozenset()
        self._fits: Callable[[str], bool] | None = None
        self._describe: Callable[[str], str] | None = None
        self._held_out_filter: PromptFilter | None = None
        self._fix = ""
        self.overlong_skips: dict[str, int] = {}
        """Per source name: draws of this process that the prompt filter refused (skipped over-long prompts)."""

    # ------------------------------------------------------------------ partition
    @property
    def names(self) -> list[str]:
        """Source names in configuration order."""
        return [s.name for s in self.sources]

    @property
    def eval_names(self) -> list[str]:
        """The held-out set's source names: the benchmarks' (``task.eval_datasets``), else :attr:`names`."""
        return [s.name for s in self.benchmarks] if self.benchmarks else self.names

    def is_eval_prompt(self, prompt: str) -> bool:
        """Whether ``prompt`` is reserved for evaluation (never produced by the train stream): one of the
        benchmarks' held-out prompts when there are benchmarks (``is_held_out``), else by hash and ``eval_modulus``."""
        if self.benchmarks:
            return self.is_held_out(prompt)
        return prompt_bucket(prompt, self.eval_modulus) == 0

    def set_prompt_filter(self, fits: Callable[[str], bool] | None, describe: Callable[[str], str] | None = None, *,
                          held_out: PromptFilter | None = None, fix: str = "") -> None:
        """Make the train stream skip prompts ``fits`` refuses, as it skips eval-only ones (None: no filter).

        ``fits``: a pure function of the prompt text (the same on every DP rank). ``describe(prompt)``: why
        a refused prompt does not fit, for the warning and errors. The held-out set skips them too (it is
        drawn again at its next use), or, given ``held_out``, the prompts that filter refuses instead: its
        prompts are generated under a cap of their own (``rl.rollout.eval_max_new_tokens``), which its warning
        names. ``fix``: what the training prompts' warning says keeps them (default: raise ``model.seq_length`` or
        lower ``rl.rollout.max_new_tokens``). Call :meth:`check_trainable` afterwards."""
        self._fits, self._describe, self._held_out_filter = fits, describe, held_out
        self._fix = fix
        self._eval = None

    @property
    def held_out_limit(self) -> str:
        """The field of the cap the held-out prompts leave room for: the one a warning about them names."""
        return self._held_out_filter.limit if self._held_out_filter is not None else "rl.rollout.max_new_tokens"

    def _why(self, prompt: str) -> str:
        return self._describe(prompt) if self._describe else f"prompt starts {prompt[:60]!r}"

    def _trainable(self, source: ProblemSource, problem: Problem) -> bool:
        """Not eval-only and accepted by the filter; a refused prompt is counted (one warning per source)."""
        return not self.is_eval_prompt(problem.prompt) and self._passes(source, problem, "training")

    def _passes(self, source: ProblemSource, problem: Problem, what: str) -> bool:
        """Accepted by the prompt filter of ``what`` (``"training"``, or ``"held-out"``: the held-out set's own
        when one is set), or none is set; a refused prompt is counted in ``overlong_skips`` under ``source.name``
        (held-out ones under ``"NAME (held-out)"``), with one warning per key."""
        own = self._held_out_filter if what != "training" else None
        fits, why, limit = (self._fits, self._why, "rl.rollout.max_new_tokens") if own is None else \
            (own.fits, own.describe or self._why, own.limit)
        fix = (self._fix if own is None else own.fix) or f"raise model.seq_length or lower {limit}"
        if fits is None or fits(problem.prompt):
            return True
        key = source.name if what == "training" else f"{source.name} (held-out)"
        skipped = self.overlong_skips.get(key, 0)
        self.overlong_skips[key] = skipped + 1
        if not skipped:
            logger.warning("%s: %s; %s prompts that do not fit are skipped (warned once per source) — %s to keep them",
                           source.name, why(problem.prompt), what, fix)
        return False

    # ------------------------------------------------------------------ rewards
    @property
    def scores_groups(self) -> bool:
        """Whether a scorer takes a problem's samples together (``task.reward_group``)."""
        return any(getattr(scorer, "scores_groups", False) for scorer in self.scorers.values())

    def score(self, problem: Problem, completion: str) -> tuple[float, bool]:
        """``(reward, correct)`` of ``completion`` for ``problem`` (see module doc for the mapping)."""
        if self.pool is not None or self.scores_groups:
            return next(self.score_each([problem], [completion]))
        return self._reward(problem, self._scorer(problem).score(problem, completion))

    def score_each(self, problems: Sequence[Problem], completions: Sequence[str],
                   group_size: int = 1) -> Iterator[tuple[float, bool]]:
        """:meth:`score` of each ``(problem, completion)`` pair, in order, raising the first failing pair's
        exception when the iteration reaches it, as calling :meth:`score` pair by pair would. Without a pool the
        pairs are scored one by one as they are asked for; with one (``task.reward_workers``) the batch is scored
        first, concurrently in the workers, up to its first failure, with the same rewards (the scores cross the
        process boundary as the floats the scorers returned). With :attr:`scores_groups`, each ``group_size``
        consecutive pairs (one problem's samples) are one call (:mod:`megatron_logra.rewards.slime_group`)."""
        if self.scores_groups:
            from megatron_logra.rewards.slime_group import group_rewards

            for problem, score in zip(problems, group_rewards(self, problems, completions, group_size)):
                yield self._reward(problem, score)
            return
        pairs = list(zip(problems, completions))
        if self.pool is None:
            for problem, completion in pairs:
                yield self.score(problem, completion)
            return
        known = next((i for i, (problem, _) in enumerate(pairs) if problem.source not in self.scorers), len(pairs))
        outcomes = self.pool.score_many([(p.source, p, c) for p, c in pairs[:known]])
        for (problem, _), outcome in zip(pairs, outcomes):
            if isinstance(outcome, BaseException):
                raise outcome
            yield self._reward(problem, outcome)
        if known < len(pairs):
            self._scorer(pairs[known][0])  # raises: a source of no scorer

    def close(self) -> None:
        """Stop the reward worker processes, if any (a later score starts fresh ones)."""
        if self.pool is not None:
            self.pool.close()

    def _scorer(self, problem: Problem) -> Scorer:
        scorer = self.scorers.get(problem.source)
        if scorer is None:
            raise ValueError(f"problem.source={problem.source!r} is not one of this task's sources {self.names}")
        return scorer

    def _reward(self, problem: Problem, score: float) -> tuple[float, bool]:
        value = float(score)
        if getattr(self.scorers.get(problem.source), "raw_rewards", False):  # the reward itself (slime's)
            if not math.isfinite(value):
                raise ValueError(f"scorer for {problem.source!r} returned the reward {value!r}; rewards must be finite")
            return value, value >= self.correct_reward
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"scorer for {problem.source!r} returned {value!r}; scores must lie in [0, 1]")
        correct = value >= 1.0
        if correct:
            return self.correct_reward, True
        if not self.graded:
            return self.wrong_reward, False
        return self.wrong_reward + value * (self.correct_reward - self.wrong_reward), False
