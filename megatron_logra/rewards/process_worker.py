"""What runs inside a reward worker process (``task.reward_workers``), and how its scorer and failures are named.

:func:`worker_main` is the target of each process that :class:`~megatron_logra.rewards.process_pool.RewardProcessPool`
starts with ``spawn``. It receives the picklable :class:`~megatron_logra.rewards.config.TaskConfig`, rebuilds the
task's scorers from it with :func:`~megatron_logra.rewards.build.build_scorers` (the same ``task.reward`` loader and
reasoning-gym datasets as the trainer's task; no scorer object is sent, only the config), and then
scores one ``(call id, source spec, problem, completion)`` message at a time on its main thread, where
math-verify's ``signal.alarm`` timeouts work (a list of completions, the samples of one problem, is one call of a
scorer of groups, ``task.reward_group``). A score goes back as the float the scorer returned (a group's as a list); an ``Exception``
goes back with its traceback, to be raised by the trainer where the in-process call would have raised it.
``SystemExit`` (``sys.exit`` in a reward function) ends the process, which the pool reports as a death.

The worker ignores ``SIGINT`` and ``SIGTERM`` (a terminal's Ctrl-C, a scheduler's stop signal reach every process
of the job; the trainer decides when to stop, and stops its workers itself) and, on Linux, asks the kernel to kill
it when the trainer dies, so that a worker stuck in C code never outlives the job.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any

from megatron_logra.rewards.config import TaskConfig
from megatron_logra.rewards.jsonl import file_spec_path
from megatron_logra.rewards.plugins import is_dotted_path, is_slime_path
from megatron_logra.rewards.remote import is_reward_url

__all__ = ["RewardWorkerDied", "describe_scorer", "signal_name", "with_remote_traceback", "worker_main"]

logger = logging.getLogger(__name__)

TRACEBACK_CHARS = 20_000
"""Characters of a worker's traceback sent back with an exception raised there."""


class RewardWorkerDied(RuntimeError):
    """A worker process died while it scored (or before it was ready); the message names the reward function,
    the process and how it ended."""


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, chained to it as its cause."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def with_remote_traceback(exc: BaseException, text: str) -> BaseException:
    """``exc`` (sent back by a worker) with the worker's traceback ``text`` chained to it as its cause."""
    exc.__cause__ = _RemoteTraceback(f"raised in a reward worker process:\n{text}")
    return exc


def signal_name(signum: int) -> str:
    """``SIGSEGV (11)`` for 11."""
    try:
        return f"{signal.Signals(signum).name} ({signum})"
    except ValueError:
        return str(signum)


def describe_scorer(cfg: TaskConfig, spec: str) -> str:
    """What scores source ``spec`` under ``cfg``, for messages (``reward function 'pkg.mod:fn'``)."""
    if is_dotted_path(cfg.reward) or is_slime_path(cfg.reward):
        return f"reward function {cfg.reward!r}"
    if is_reward_url(cfg.reward):
        return f"reward server {cfg.reward}"
    if file_spec_path(spec) is not None or cfg.reward == "math_verify":
        return f"math-verify (source {spec!r})"
    return f"reasoning-gym's {spec} score_answer"


def _die_with_parent(parent_pid: int) -> None:
    """Linux: ask the kernel to kill this process when its parent dies (even mid C call, even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling, else a ``RuntimeError`` with its type and message."""
    try:
        ForkingPickler.loads(ForkingPickler.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception type pickle cannot rebuild
        return RuntimeError(f"{type(exc).__qualname__}: {exc}")


def worker_main(conn: Any, cfg: TaskConfig, parent_pid: int, die_with_parent: bool) -> None:
    """A worker's loop: build the scorers, say ``ready``, then score ``(call_id, spec, problem, completion)``
    messages one at a time until ``None`` or the pipe closes. Only ``Exception`` is sent back: ``SystemExit``
    ends the process, which the pool reports as a death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if die_with_parent:
        _die_with_parent(parent_pid)
    try:
        from megatron_logra.rewards.build import build_scorers

        scorers = build_scorers(cfg)
    except Exception as exc:  # noqa: BLE001 - reported by the pool
        conn.send(("setup_error", _sendable(exc), traceback.format_exc()[-TRACEBACK_CHARS:]))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if message is None:
            return
        call_id, spec, problem, completion = message
        try:
            if isinstance(completion, list):  # a problem's samples, scored together (task.reward_group)
                conn.send(("ok", call_id, [float(v) for v in scorers[spec].score_group(problem, completion)]))
            else:
                conn.send(("ok", call_id, float(scorers[spec].score(problem, completion))))
        except Exception as exc:  # noqa: BLE001 - the caller raises it where the in-process call would
            conn.send(("error", call_id, _sendable(exc), traceback.format_exc()[-TRACEBACK_CHARS:]))
