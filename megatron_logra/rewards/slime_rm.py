"""slime's reward functions, called as they are (``task.reward=slime:package.module:function``).

A reward function written for slime's ``--custom-rm-path package.module.function`` is ``async def rm(args,
sample) -> float`` (or a plain ``def``), called with slime's ``Sample`` and its argparse namespace. So that such
a function runs here unchanged, :class:`SlimeScorer` calls it once per completion with:

* ``sample``: a :class:`SlimeSample`, the attributes of slime's ``Sample`` a reward function reads, under slime's
  names: ``prompt`` (the problem's text as its source gives it, before ``rl.prompt_template`` and the chat
  template), ``response`` (the completion), ``label`` (the reference answer as the row gave it: a JSON number stays a
  number, as slime passes it; text otherwise; None where the source has none), ``metadata`` (a copy of the problem's metadata, for a JSONL row its ``metadata`` object and other keys,
  with ``source``: the ``task.datasets`` entry, where the row has none of its own), ``status`` (``Sample.Status.COMPLETED``: the scorer is not told
  whether a completion was cut at ``rl.rollout.max_new_tokens``), ``reward`` (None) and ``index`` /
  ``group_index`` (None). Token-level fields (``tokens``, ``response_length``, ``loss_mask``, ...) are not
  available: reading one raises an AttributeError that says so, rather than handing the function a made-up value.
* ``args``: a :class:`SlimeArgs` (an ``argparse.Namespace``) of slime's names for what this trainer knows
  (:func:`slime_args`): ``custom_rm_path``, ``input_key`` / ``label_key`` (``task.jsonl_prompt_key`` /
  ``task.jsonl_answer_key``, None when empty), ``metadata_key``, ``rollout_seed`` (``task.seed``), ``rm_type`` /
  ``rm_url`` / ``reward_key`` (None), ``group_rm`` (``task.reward_group``) and, where the RL job builds the task,
  the fields of :data:`RUN_FIELDS` (``n_samples_per_prompt`` from ``rl.group_size``, ...). The same ``args`` at a
  held-out evaluation, as slime's: ``rollout_max_response_len`` is the training cap there too, and
  ``eval_max_response_len`` the evaluation's (``rl.rollout.eval_max_new_tokens``; None where that is 0, as for
  slime's unset ``--eval-max-response-len``: the evaluation then generates as training does). Another field
  raises an AttributeError naming it (``getattr(args, name, default)`` works as in slime).

A coroutine (the function is ``async``, or returns an awaitable) runs to completion on an event loop private to
the calling thread and kept from call to call, as slime's rollout keeps one: an ``aiohttp`` session a function
keeps in a global (slime's own ``remote_rm`` does) stays usable. It runs under ``task.reward_timeout_s`` as any
reward function does (:mod:`megatron_logra.rewards.deadline`: on the main thread the interrupt ends the loop's
wait, and the call's task is cancelled), and in reward worker processes (``task.reward_workers``) alike.

**Rewards.** The function's float is the reward, as in slime (1 / 0, -1 / 1, any scale): it is not a score in
``[0, 1]``. A reward >= ``task.correct_reward`` counts as correct (the accuracy metrics); ``task.wrong_reward``
and ``task.graded`` are not used (:class:`~megatron_logra.rewards.task.Task`). A non-finite value, a non-number, a
list (a function written for slime's ``--group-rm``, which takes the samples of a prompt together: it is called
so with ``task.reward_group=true``, :mod:`megatron_logra.rewards.slime_group`) or a dict (slime's
``--reward-key``) is a ``ValueError`` naming the function and the value.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import logging
import math
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Union

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.plugins import SLIME_PREFIX, PluginScorer, is_slime_path, load_reward_fn

if TYPE_CHECKING:
    from megatron_logra.rewards.config import TaskConfig

__all__ = ["CANCEL_WAIT_S", "RUN_ARGS_ATTR", "RUN_FIELDS", "SlimeArgs", "SlimeSample", "SlimeScorer",
           "run_awaitable", "run_args", "sample_of", "slime_args", "with_run_args"]

logger = logging.getLogger(__name__)

RUN_FIELDS: dict[str, str] = {
    "n_samples_per_prompt": "rl.group_size",
    "rollout_batch_size": "rl.prompts_per_step",
    "rollout_max_response_len": "rl.rollout.max_new_tokens",
    "rollout_temperature": "rl.rollout.temperature",
    "rollout_top_p": "rl.rollout.top_p",
    "apply_chat_template": "rl.chat_template",
    "n_samples_per_eval_prompt": "rl.rollout.eval_samples",
    "eval_max_response_len": "rl.rollout.eval_max_new_tokens",
}
"""slime's ``args`` fields the RL job fills from its own config (slime's flag ``--n-samples-per-prompt`` is
``rl.group_size`` here, ...): known where the task is built for an RL run (:func:`with_run_args`)."""

RUN_ARGS_ATTR = "slime_run_args"
"""The attribute of a :class:`~megatron_logra.rewards.config.TaskConfig` copy holding the :data:`RUN_FIELDS` values:
it travels with the config into reward worker processes, which rebuild their scorers from it."""

CANCEL_WAIT_S = 1.0
"""Seconds an interrupted coroutine (its time limit, Ctrl-C) is given to unwind after it is cancelled."""

_UNAVAILABLE = ("tokens", "response_length", "effective_response_length", "loss_mask", "rollout_log_probs",
                "multimodal_inputs", "weight_versions", "teacher_log_probs")
_loops = threading.local()


class _NotAList(TypeError):
    """A :class:`SlimeSample` used as a list of samples (a function written for slime's ``--group-rm``)."""


class SlimeArgs(argparse.Namespace):
    """slime's ``args`` as far as this trainer knows them (see the module doc); a missing field is an
    AttributeError naming it, and for a :data:`RUN_FIELDS` one, where it comes from."""

    def __getattr__(self, name: str) -> Any:  # only called for a field that is not set
        if name.startswith("__"):
            raise AttributeError(name)
        if name in RUN_FIELDS:
            raise AttributeError(f"args.{name} (slime's) is {RUN_FIELDS[name]} here, known only when the RL job "
                                 f"builds the task (megatron-logra train / eval), not to a task built on its own")
        known = ", ".join(sorted(vars(self)))
        raise AttributeError(f"args.{name}: slime's args namespace is not reproduced here; a task.reward=slime:... "
                             f"function gets these fields: {known} (use getattr(args, {name!r}, default))")


@dataclass
class SlimeSample:
    """The attributes of slime's ``Sample`` that a reward function reads (see the module doc)."""

    class Status(Enum):
        """slime's ``Sample.Status`` values."""

        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: Optional[int] = None
    index: Optional[int] = None
    prompt: Union[str, list] = ""
    response: str = ""
    label: Optional[Union[str, int, float]] = None
    reward: Optional[float] = None
    status: SlimeSample.Status = Status.COMPLETED
    metadata: dict = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:  # only called for an attribute that is not set
        if name in _UNAVAILABLE:
            raise AttributeError(f"sample.{name}: token-level fields of slime's Sample are not available to a "
                                 f"task.reward=slime:... function, which is scored from the text (sample.response); "
                                 f"for a length penalty use rl.overlong_buffer")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _not_a_list(self, *_: Any) -> Any:
        raise _NotAList("sample is one slime Sample, not a list: task.reward=slime:... calls rm(args, sample) once "
                        "per completion; a function written for slime's --group-rm (rm(args, samples) -> list) is "
                        "called so with task.reward_group=true (--group-rm)")

    __iter__ = __len__ = __getitem__ = _not_a_list

    def __bool__(self) -> bool:  # ``if sample:`` is true, as for slime's Sample (no __len__ asked)
        return True


def sample_of(problem: Problem, completion: str) -> SlimeSample:
    """The :class:`SlimeSample` of ``completion`` for ``problem``; its metadata a deep copy, so a function that
    changes it changes no other sample."""
    metadata = copy.deepcopy(problem.metadata)
    metadata.setdefault("source", problem.source)
    return SlimeSample(prompt=problem.prompt, response=completion,
                       label=_label(problem), metadata=metadata)


def _label(problem: Problem) -> Optional[Union[str, int, float]]:
    """slime's ``Sample.label``: the row's JSON value (a number stays one), else the answer text; None without one."""
    if not problem.has_answer:
        return None
    return problem.raw_answer if problem.raw_answer is not None else problem.answer


def run_args(rl: Any) -> dict[str, Any]:
    """The :data:`RUN_FIELDS` values of an RL config (``RunConfig.rl``), by slime's names."""
    values = {}
    for name, dotted in RUN_FIELDS.items():
        value = rl
        for part in dotted.split(".")[1:]:
            value = getattr(value, part)
        values[name] = value
    if not values["eval_max_response_len"]:  # 0: the evaluation's cap is training's, as slime's unset flag (None)
        values["eval_max_response_len"] = None
    return values


def with_run_args(cfg: TaskConfig, rl: Any) -> TaskConfig:
    """``cfg`` itself, or for a slime reward function a copy carrying :func:`run_args` of ``rl`` (the caller's
    config is left as it is, so that what is saved and compared on resume is the user's)."""
    if not is_slime_path(cfg.reward):
        return cfg
    carried = copy.copy(cfg)
    setattr(carried, RUN_ARGS_ATTR, run_args(rl))
    return carried


def slime_args(cfg: TaskConfig) -> SlimeArgs:
    """The ``args`` a slime reward function of ``cfg`` is called with (see the module doc)."""
    path = cfg.reward[len(SLIME_PREFIX):] if is_slime_path(cfg.reward) else None
    return SlimeArgs(custom_rm_path=path.replace(":", ".") if path else None, input_key=cfg.jsonl_prompt_key or None,
                     label_key=cfg.jsonl_answer_key or None, metadata_key="metadata", rollout_seed=cfg.seed,
                     rm_type=None, rm_url=None, reward_key=None, group_rm=bool(getattr(cfg, "reward_group", False)),
                     **getattr(cfg, RUN_ARGS_ATTR, {}))


def run_awaitable(awaitable: Awaitable[Any]) -> Any:
    """The result of ``awaitable``, run to completion on this thread's own event loop (made at its first use,
    then kept). Interrupted (a time limit's signal, Ctrl-C), its task is cancelled and given
    :data:`CANCEL_WAIT_S` to unwind before the interrupt goes on."""
    loop = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loops.loop = asyncio.new_event_loop()
    future = asyncio.ensure_future(awaitable, loop=loop)
    try:
        return loop.run_until_complete(future)
    finally:
        if not future.done():
            future.cancel()
            try:
                loop.run_until_complete(asyncio.wait([future], timeout=CANCEL_WAIT_S))
            except BaseException:  # noqa: BLE001 - a second interrupt (the limit's repeat): the first one goes on
                pass


class _SlimeCall:
    """``fn(args, sample)`` as a ``(problem, completion)`` function, its coroutine run, a list or dict refused."""

    def __init__(self, path: str, fn: Callable[..., Any], args: SlimeArgs) -> None:
        self.path, self.fn, self.args = path, fn, args

    def __call__(self, problem: Problem, completion: str) -> Any:
        try:
            value = self.fn(self.args, sample_of(problem, completion))
            if inspect.isawaitable(value):
                value = run_awaitable(value)
        except _NotAList as exc:
            raise TypeError(f"reward function {self.path!r}: {exc}") from exc
        if isinstance(value, (list, tuple)):
            raise ValueError(f"reward function {self.path!r} returned a {type(value).__name__} of {len(value)} "
                             f"values; expected one reward (a number) per call: a function written for slime's "
                             f"--group-rm (rm(args, samples) -> list[float]) is called so with "
                             f"task.reward_group=true (--group-rm)")
        if isinstance(value, dict):
            raise ValueError(f"reward function {self.path!r} returned a dict (keys {sorted(map(str, value))[:8]}); "
                             f"slime's --reward-key is not supported: return the reward as a number")
        return value


class SlimeScorer(PluginScorer):
    """A :class:`~megatron_logra.rewards.plugins.PluginScorer` around a slime reward function (see the module doc):
    its float is the reward itself (:attr:`raw_rewards`), any finite number; the time limit, the errors and the
    number types accepted are the plugin's."""

    raw_rewards = True
    """The scores are rewards, used as they are (:class:`~megatron_logra.rewards.task.Task`)."""
    _RANGE = (-math.inf, math.inf)
    _EXPECTED = "a finite number (the reward)"

    def __init__(self, path: str, timeout_s: Optional[float] = None, args: Optional[SlimeArgs] = None) -> None:
        self.args = args if args is not None else SlimeArgs()
        super().__init__(path, timeout_s)

    def _load(self, path: str) -> Callable[[Problem, str], Any]:
        if not is_slime_path(path):
            raise ValueError(f"reward function {path!r}: a slime reward function is 'slime:package.module:function'")
        from megatron_logra.rewards.slime_group import refuse_group_rm

        fn = load_reward_fn(path)
        refuse_group_rm(path, fn)
        return _SlimeCall(path, fn, self.args)
