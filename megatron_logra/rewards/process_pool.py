"""Scoring rewards in worker processes (``task.reward_workers``), each call under a hard time limit.

In the trainer's process ``task.reward_timeout_s`` interrupts Python code only
(:mod:`megatron_logra.rewards.deadline`): C code that holds the GIL (a catastrophic ``re`` backtrack, a huge
sympy simplification) runs on, and a function that crashes (``os._exit``, a segfault) takes the trainer with it.
A :class:`RewardProcessPool` scores in ``task.reward_workers`` processes instead:

* **Same scores.** A worker rebuilds the task's scorers from the config
  (:func:`~megatron_logra.rewards.build.build_scorers`: the same ``task.reward`` loader and reasoning-gym datasets
  as :func:`~megatron_logra.rewards.build.build_task`) and returns each score as the float the scorer gave: the
  rewards are bit-identical. A batch's calls run concurrently, one per worker; results keep the batch's order.
* **Hard limit.** A call past ``task.reward_timeout_s`` (0: none) has its worker killed (``SIGKILL``: a stuck C
  call ignores anything else) and replaced; its outcome is
  :class:`~megatron_logra.rewards.deadline.RewardTimeout`, as in process (the RL step makes it a ``RewardError``).
  The limit counts from the hand-over to a ready worker: a worker's start (imports, datasets) is not counted
  (it may take :data:`START_TIMEOUT_S`).
* **Crashes.** A worker that dies in a call (``os._exit``, ``sys.exit``, a segfault, the out-of-memory killer)
  gives :class:`RewardWorkerDied` naming the reward function and the exit code or signal, and is replaced.
* **Lifetime.** Workers start lazily (at the first batch) with ``spawn`` (forking a process that holds torch /
  gloo threads is unsafe) and are reused from step to step (:mod:`megatron_logra.rewards.process_worker`: what
  runs in them). :meth:`RewardProcessPool.close` stops them (a stop message, ``SIGKILL`` after :data:`GRACE_S`);
  :func:`closing_reward_workers` closes the pools a job started, also when it raises; the others close at
  interpreter exit, and on Linux the kernel kills a worker when the trainer dies.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401 - its exit handler (which joins children) must run after ours
import os
import threading
import time
import weakref
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional, Sequence, TypeVar

from megatron_logra.rewards.config import TaskConfig
from megatron_logra.rewards.deadline import RewardTimeout
from megatron_logra.rewards.process_worker import (RewardWorkerDied, describe_scorer, signal_name,
                                                   with_remote_traceback, worker_main)

__all__ = ["GRACE_S", "START_TIMEOUT_S", "RewardProcessPool", "RewardWorkerDied", "closing_reward_workers"]

logger = logging.getLogger(__name__)

GRACE_S = 0.5
"""Seconds :meth:`RewardProcessPool.close` lets a worker exit on its own before it is killed."""

START_TIMEOUT_S = 300.0
"""Seconds a worker may take to start and build its scorers."""


class _Worker:
    """A worker process, its pipe and its state: ``starting``, ``idle`` or ``busy`` (call ``index``)."""

    def __init__(self, process: Any, conn: Any) -> None:
        self.process, self.conn = process, conn
        self.state = "starting"
        self.index = -1
        self.call_id = -1
        self.failed = False  # sent the error that kept it from starting
        self.deadline: Optional[float] = time.monotonic() + START_TIMEOUT_S

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join()
        self.conn.close()


def _stop(workers: list[Optional[_Worker]]) -> None:
    """Stop every worker of ``workers`` (a stop message, :data:`GRACE_S`, then ``SIGKILL``) and empty the slots."""
    live = [w for w in workers if w is not None]
    for w in live:
        try:
            w.conn.send_bytes(ForkingPickler.dumps(None))
        except OSError:
            pass
    end = time.monotonic() + GRACE_S
    for w in live:
        w.process.join(max(0.0, end - time.monotonic()))
        w.kill()
    workers[:] = [None] * len(workers)


class _Batch:
    """The outcomes of one :meth:`RewardProcessPool.score_many` call."""

    def __init__(self, calls: Sequence[tuple[str, Any, str]]) -> None:
        self.calls = calls
        self.outcomes: list[Any] = [None] * len(calls)
        self.next = 0
        self.end = len(calls)  # no call at or past it is sent: an earlier one failed

    def fail(self, index: int, exc: BaseException) -> None:
        self.outcomes[index] = exc
        self.end = min(self.end, index + 1)


_RUNNING: "weakref.WeakSet[RewardProcessPool]" = weakref.WeakSet()
"""Pools with workers started."""


class RewardProcessPool:
    """``cfg.reward_workers`` worker processes scoring the sources of ``cfg`` (see the module doc).

    Thread-safe (one batch at a time); a copy (``copy``, ``pickle``) starts workers of its own.
    """

    def __init__(self, cfg: TaskConfig) -> None:
        if cfg.reward_workers < 1:
            raise ValueError(f"task.reward_workers={cfg.reward_workers}: a pool needs a worker")
        self.cfg = cfg
        self.size = int(cfg.reward_workers)
        self.timeout_s: Optional[float] = float(cfg.reward_timeout_s) if cfg.reward_timeout_s else None
        self._workers: list[Optional[_Worker]] = [None] * self.size
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._start_error: Optional[BaseException] = None
        weakref.finalize(self, _stop, self._workers)  # a pool dropped without close()

    def __reduce__(self) -> tuple[Any, ...]:
        return RewardProcessPool, (self.cfg,)

    def pids(self) -> list[int]:
        """The process ids of the workers now started."""
        return [w.process.pid for w in self._workers if w is not None]

    def close(self) -> None:
        """Stop the workers (a busy one is killed after :data:`GRACE_S`); a later batch starts fresh ones."""
        with self._lock:
            _stop(self._workers)
            _RUNNING.discard(self)

    def score_many(self, calls: Sequence[tuple[str, Any, str]]) -> list[Any]:
        """The outcome of each ``(source spec, problem, completion)`` in ``calls``, in order: the score (a float,
        as the source's scorer returned it; for a list of completions, a problem's samples scored together under
        ``task.reward_group``, the list of their scores) or the exception of a call that failed (raised in the worker,
        :class:`~megatron_logra.rewards.deadline.RewardTimeout`, :class:`RewardWorkerDied`). Calls after the
        first failure are not scored (None; a worker still in one is replaced), as in process."""
        if not calls:
            return []
        with self._lock:
            batch = _Batch(calls)
            try:
                self._run(batch)
            except BaseException:  # KeyboardInterrupt: a busy worker's answer is stale
                for slot, w in enumerate(self._workers):
                    if w is not None and w.state == "busy":
                        w.kill()
                        self._workers[slot] = None
                raise
            return batch.outcomes

    # ------------------------------------------------------------------ internals
    def _start(self, slot: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        main = threading.current_thread() is threading.main_thread()  # PDEATHSIG follows the starting thread
        process = ctx.Process(target=worker_main, args=(child_conn, self.cfg, os.getpid(), main),
                              name=f"reward-worker-{slot}", daemon=False)  # a daemon could not start processes
        process.start()
        child_conn.close()
        self._workers[slot] = _Worker(process, parent_conn)
        _RUNNING.add(self)

    def _run(self, batch: _Batch) -> None:
        self._start_error = None
        started = [slot for slot, w in enumerate(self._workers) if w is None]
        for slot in started:
            self._start(slot)
        if len(started) == self.size:
            logger.info("scoring rewards in %d worker processes (task.reward_workers; task.reward_timeout_s=%g)",
                        self.size, self.timeout_s or 0)
        while True:
            for slot, w in enumerate(self._workers):
                if batch.next < batch.end and w is not None and w.state == "idle":
                    self._send(slot, w, batch)
                elif w is not None and w.state == "busy" and w.index >= batch.end:  # past a failure: unused
                    w.kill()
                    self._start(slot)
            live = [w for w in self._workers if w is not None]
            if not any(w.state == "busy" for w in live) and batch.next >= batch.end:
                return
            if not live:  # every worker failed to start: the next call gets that error
                batch.fail(batch.next, self._start_error or RewardWorkerDied("no reward worker process started"))
                return
            self._wait(batch, live)

    def _send(self, slot: int, w: _Worker, batch: _Batch) -> None:
        index = batch.next
        spec, problem, completion = batch.calls[index]
        call_id = next(self._ids)
        try:
            data = ForkingPickler.dumps((call_id, spec, problem, completion))
        except Exception as exc:  # noqa: BLE001 - a problem whose metadata pickle cannot take
            batch.fail(index, ValueError(f"cannot send the sample to a reward worker: {type(exc).__name__}: {exc}"))
            batch.next += 1
            return
        try:
            w.conn.send_bytes(data)
        except OSError:  # died while idle: the call goes to another worker
            self._died(slot, w, batch)
            return
        w.state, w.index, w.call_id = "busy", index, call_id
        w.deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        batch.next += 1

    def _wait(self, batch: _Batch, live: list[_Worker]) -> None:
        deadlines = [w.deadline for w in live if w.deadline is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = set(wait([w.conn for w in live] + [w.process.sentinel for w in live], timeout))
        for slot, w in enumerate(self._workers):
            if w is not None and (w.conn in ready or w.process.sentinel in ready):
                self._receive(slot, w, batch)
        now = time.monotonic()
        for slot, w in enumerate(self._workers):
            # not one that answered since the wait: the next wait reads it
            if w is not None and w.deadline is not None and now >= w.deadline and not w.conn.poll(0):
                self._expired(slot, w, batch)

    def _receive(self, slot: int, w: _Worker, batch: _Batch) -> None:
        ended = False
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), batch)
        except (EOFError, OSError):  # the pipe closed: the process is ending
            ended = True
        if ended or w.failed or w.process.exitcode is not None:
            self._died(slot, w, batch)

    def _handle(self, w: _Worker, message: tuple[Any, ...], batch: _Batch) -> None:
        kind = message[0]
        if kind == "ready":
            w.state, w.deadline = "idle", None
        elif kind == "setup_error":
            self._start_error, w.failed = with_remote_traceback(message[1], message[2]), True
        elif w.state == "busy" and message[1] == w.call_id:
            if kind == "ok":
                batch.outcomes[w.index] = message[2]
            else:
                batch.fail(w.index, with_remote_traceback(message[2], message[3]))
            w.state, w.deadline = "idle", None

    def _died(self, slot: int, w: _Worker, batch: _Batch) -> None:
        """``w`` ended or failed to start: report it; a fresh worker replaces one that had started."""
        w.process.join(GRACE_S)
        w.kill()
        code = w.process.exitcode
        how = (f"it was killed by signal {signal_name(-code)}" if code is not None and code < 0 else
               f"it exited with code {code}")
        if w.state == "starting":
            self._workers[slot] = None
            self._start_error = self._start_error or RewardWorkerDied(
                f"a reward worker process (pid {w.process.pid}, task.reward_workers={self.size}) did not start: {how} "
                f"(its error is printed above; a script that starts the job must keep its code under "
                f"if __name__ == '__main__': spawn imports the main module)")
            return
        if w.state == "busy":
            batch.fail(w.index, RewardWorkerDied(
                f"{describe_scorer(self.cfg, batch.calls[w.index][0])} ended its reward worker process (pid "
                f"{w.process.pid}) while scoring: {how}. A reward function must return a score, not end the "
                f"process (os._exit, sys.exit), crash it (a segfault) or run it out of memory; a fresh worker "
                f"replaces it"))
        else:
            logger.warning("reward worker process (pid %d) ended while idle: %s; starting a fresh one",
                           w.process.pid, how)
        self._start(slot)

    def _expired(self, slot: int, w: _Worker, batch: _Batch) -> None:
        w.kill()
        if w.state == "starting":
            self._workers[slot] = None
            self._start_error = RewardWorkerDied(f"a reward worker process (pid {w.process.pid}) did not start "
                                                 f"(build its scorers) within {START_TIMEOUT_S:g} s; it was killed")
            return
        t, what = self.timeout_s or 0.0, describe_scorer(self.cfg, batch.calls[w.index][0])
        batch.fail(w.index, RewardTimeout(
            f"{what} did not return within {t:g} s (task.reward_timeout_s={t:g}); its worker process (pid "
            f"{w.process.pid}) was killed and replaced. Fix the function (a sandbox or HTTP call needs its own "
            f"timeout), or raise task.reward_timeout_s if it is merely slow (0 disables the limit)"))
        self._start(slot)


F = TypeVar("F", bound=Callable[..., Any])


def closing_reward_workers(fn: F) -> F:
    """Decorate a job: the reward worker pools started during a call of ``fn`` are closed when it ends."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = set(map(id, _RUNNING))
        try:
            return fn(*args, **kwargs)
        finally:
            for pool in [p for p in list(_RUNNING) if id(p) not in before]:
                pool.close()

    return wrapper  # type: ignore[return-value]


@atexit.register
def _close_all() -> None:
    """At interpreter exit, before multiprocessing's handler, which waits for every child."""
    for pool in list(_RUNNING):
        pool.close()
