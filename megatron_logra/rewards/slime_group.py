"""slime's ``--group-rm`` reward functions (``task.reward_group=true``): one call per prompt with all its samples.

A function written for slime's ``--group-rm`` is ``[async] def rm(args, samples) -> list[float]``: slime calls it once
per prompt group with the list of that group's samples (its ``batched_async_rm``) and sets each sample's reward from
the list, in order. :class:`SlimeGroupScorer` calls it the same way:

* **Groups.** A training step's group is a prompt's ``rl.group_size`` rollouts; a held-out evaluation's is a
  problem's ``rl.rollout.eval_samples`` completions (one, greedy by default). slime refuses ``--group-rm`` at
  evaluation (its eval rollout asserts it off); here the evaluation calls the function per problem instead, so a
  run with held-out problems works (``args.n_samples_per_eval_prompt`` is that group's size; ``task.num_eval=0``
  evaluates nothing, as slime's line without ``--eval-prompt-data``). Each sample is the
  :class:`~megatron_logra.rewards.slime_rm.SlimeSample` a per-sample call gets; ``args`` is the same, with
  ``group_rm`` True.
* **Rewards.** The list must hold one finite number per sample (a list, a tuple, a one-dimensional numpy array or
  tensor); a value that is no list is a ``TypeError``, a list of another length or holding a non-finite value or a
  non-number a ``ValueError``, each naming the function. Each number is a sample's reward as a per-sample slime
  function's is (``task.correct_reward`` decides what counts as correct).
* **Limits and workers.** ``task.reward_timeout_s`` bounds one call, that is one whole group; with
  ``task.reward_workers`` a worker process scores one group per call (:func:`group_rewards`), under the same limit.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.plugins import is_slime_path, load_reward_fn
from megatron_logra.rewards.slime_rm import SlimeScorer, run_awaitable, sample_of

if TYPE_CHECKING:
    from megatron_logra.rewards.slime_rm import SlimeArgs

__all__ = ["SlimeGroupScorer", "group_rewards", "refuse_group_rm", "sample_note"]

logger = logging.getLogger(__name__)

_GROUP_NOTE = re.compile(r"^['\"]?(typing\.|collections\.abc\.)?(list|List|Sequence|Iterable|tuple|Tuple)\b")
_FLAG = "task.reward_group=true, slime's --group-rm"


def sample_note(fn: Callable[..., Any]) -> Optional[tuple[str, str, bool]]:
    """``(name, annotation text, whether it is a list)`` of ``fn``'s second parameter, None where it has none."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(params) < 2 or params[1].annotation is params[1].empty:
        return None
    note = params[1].annotation
    text = note if isinstance(note, str) else note.__name__ if isinstance(note, type) else repr(note)
    return params[1].name, text, bool(_GROUP_NOTE.match(text.strip()))


def refuse_group_rm(path: str, fn: Callable[..., Any]) -> None:
    """ValueError when ``fn``'s second parameter is annotated as a list of samples (slime's ``--group-rm``) and it
    is to be called per sample."""
    note = sample_note(fn)
    if note is not None and note[2]:
        raise ValueError(f"reward function {path!r}: its {note[0]!r} is annotated {note[1]!r}, a list of samples: "
                         f"a function written for slime's --group-rm (rm(args, samples) -> list[float]) is called so "
                         f"with task.reward_group=true (--group-rm); without it task.reward=slime:... calls "
                         f"rm(args, sample) once per completion")


class _SlimeGroupCall:
    """``fn(args, samples)`` as a ``(problem, completions)`` function, its coroutine run, a dict refused."""

    def __init__(self, path: str, fn: Callable[..., Any], args: SlimeArgs) -> None:
        self.path, self.fn, self.args = path, fn, args

    def __call__(self, problem: Problem, completions: Sequence[str]) -> Any:
        value = self.fn(self.args, [sample_of(problem, completion) for completion in completions])
        if inspect.isawaitable(value):
            value = run_awaitable(value)
        if isinstance(value, dict):
            raise ValueError(f"reward function {self.path!r} returned a dict (keys {sorted(map(str, value))[:8]}); "
                             f"slime's --reward-key is not supported: return the rewards as a list of numbers")
        return value


class SlimeGroupScorer(SlimeScorer):
    """A :class:`~megatron_logra.rewards.slime_rm.SlimeScorer` whose function scores a prompt's samples together
    (see the module doc): :meth:`score_group`; :meth:`score` of one completion is a group of one."""

    scores_groups = True
    """Score a prompt's samples together (:meth:`score_group`; :class:`~megatron_logra.rewards.task.Task`)."""

    def _load(self, path: str) -> Callable[[Problem, Any], Any]:
        if not is_slime_path(path):
            raise ValueError(f"reward function {path!r}: task.reward_group=true calls a slime reward function, "
                             f"'slime:package.module:function'")
        fn = load_reward_fn(path)
        note = sample_note(fn)
        if note is not None and not note[2] and "sample" in note[1].lower():
            raise ValueError(f"reward function {path!r}: its {note[0]!r} is annotated {note[1]!r}, one sample, but "
                             f"{_FLAG} calls rm(args, samples) with the list of a prompt's samples: give a function "
                             f"that returns one reward per sample, or task.reward_group=false to call this one per "
                             f"completion")
        return _SlimeGroupCall(path, fn, self.args)

    def score(self, problem: Problem, completion: str) -> float:
        """The reward of ``completion`` alone: a group of one."""
        return self.score_group(problem, [completion])[0]

    def score_group(self, problem: Problem, completions: Sequence[str]) -> list[float]:
        """One call of the function for ``completions`` (the samples of ``problem``), within ``timeout_s``: a
        checked finite reward per completion, in order."""
        completions = list(completions)
        return self._rewards(self._call(problem, completions), len(completions))

    def _rewards(self, value: Any, count: int) -> list[float]:
        module = type(value).__module__.split(".")[0]
        if module in ("numpy", "torch") and callable(getattr(value, "tolist", None)) \
                and len(getattr(value, "shape", ())) == 1:
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"reward function {self.path!r} returned {value!r} ({type(value).__name__}); with {_FLAG} "
                            f"it must return a list of one reward per sample of the group ({count} here)")
        if len(value) != count:
            raise ValueError(f"reward function {self.path!r} returned {len(value)} rewards for a group of {count} "
                             f"samples ({_FLAG}); expected one reward per sample, in the samples' order")
        return [self._checked(v, f" at index {i} of its list") for i, v in enumerate(value)]


def group_rewards(task: Any, problems: Sequence[Problem], completions: Sequence[str],
                  group_size: int) -> Iterator[float]:
    """The score of each completion under ``task``'s group scorers, in order, ``group_size`` consecutive ones (the
    samples of one problem) per call: in ``task.pool``'s worker processes where it has one (all groups at once,
    concurrently), else group by group as they are asked for. A failing group raises when the iteration reaches
    its first sample, as a per-sample call would; the groups before it are yielded."""
    if group_size < 1 or len(problems) % group_size or len(problems) != len(completions):
        raise ValueError(f"{len(completions)} completions of {len(problems)} problems do not split into groups of "
                         f"{group_size} (task.reward_group scores a prompt's samples together)")
    groups = [(problems[i], list(completions[i:i + group_size])) for i in range(0, len(problems), group_size)]
    for k, (problem, _) in enumerate(groups):
        if any(p is not problem and p != problem for p in problems[k * group_size:(k + 1) * group_size]):
            raise ValueError(f"task.reward_group: the samples {k * group_size}..{(k + 1) * group_size - 1} scored "
                             f"together answer different problems; a group is one problem's samples")
    if task.pool is not None:
        known = next((k for k, (p, _) in enumerate(groups) if p.source not in task.scorers), len(groups))
        outcomes: list[Any] = task.pool.score_many([(p.source, p, c) for p, c in groups[:known]])
        outcomes += [None] * (len(groups) - known)
    for k, (problem, group) in enumerate(groups):
        scorer = task._scorer(problem)  # a source of no scorer raises here
        outcome = outcomes[k] if task.pool is not None else scorer.score_group(problem, group)
        if isinstance(outcome, BaseException):
            raise outcome
        yield from outcome
