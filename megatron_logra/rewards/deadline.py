"""Calling a user's reward function with a time limit (``task.reward_timeout_s``).

Python cannot stop a running function from outside, so the limit is enforced in one of two ways:

* **On the main thread** (the RL loop's): the function runs right there, where ``signal.alarm`` still works
  (math-verify's own ``parsing_timeout`` / ``timeout_seconds`` rely on it), and a watchdog thread sends the
  main thread a signal of its own (a real-time signal, never ``SIGALRM``, ``SIGINT``, ``SIGTERM`` or
  ``SIGUSR1/2``, which clusters and libraries use) once the limit has passed. Its handler raises
  :class:`DeadlineExceeded`, a ``BaseException``, so a function's ``except Exception`` (math-verify's
  ``verify`` returns False on any error) cannot swallow it; the signal is sent again every second until the
  call ends. A call that ends after its limit is a :class:`RewardTimeout` even if it returned a value (a
  swallowed interrupt leaves a made-up score). This interrupts sleeps, socket waits and Python loops; not C
  code that holds the GIL (a catastrophic ``re`` backtrack, a huge sympy simplification): for that, set
  ``task.reward_workers`` to score in worker processes, where a call past its limit has its process killed
  (:mod:`megatron_logra.rewards.process_pool`; this module is then not used).
* **On any other thread**, or where that signal is taken by someone else: the function runs on a daemon
  worker thread and the caller waits for it; a call past its limit is abandoned (it goes on in the
  background; a daemon thread never keeps the process from exiting) and the next call gets a fresh worker.
  ``signal.alarm`` is unavailable there (see :func:`needs_main_thread`).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

__all__ = ["DeadlineExceeded", "RewardTimeout", "Worker", "call_on_main_thread", "main_thread_deadlines",
           "needs_main_thread"]

_RESEND_S = 1.0
"""Seconds between repeats of the watchdog's signal while a call is past its limit."""


class RewardTimeout(TimeoutError):
    """A reward function did not return within ``task.reward_timeout_s``; the message names the function,
    the limit and the field."""


class DeadlineExceeded(BaseException):
    """Raised inside the timed call by the watchdog's signal; a ``BaseException`` so that the function's own
    ``except Exception`` does not swallow it. Never escapes the outermost :func:`call_on_main_thread` (a call
    nested in another runs under the enclosing call's deadline)."""


class _Deadline:
    __slots__ = ("due", "fired")

    def __init__(self, due: float) -> None:
        self.due = due
        self.fired = False


class _Watchdog:
    """Signals the main thread when the armed call's deadline passes (one per process)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.main = threading.main_thread().ident
        self.cond = threading.Condition()
        self.armed: Optional[_Deadline] = None
        signal.signal(signum, self._on_signal)
        threading.Thread(target=self._loop, name="reward-deadline", daemon=True).start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        armed = self.armed
        if armed is not None and armed.fired:  # else a late signal of a call that already ended: ignored
            raise DeadlineExceeded()

    def _loop(self) -> None:
        with self.cond:
            while True:
                armed = self.armed
                if armed is None:
                    self.cond.wait()
                    continue
                left = armed.due - time.monotonic()
                if left > 0:
                    self.cond.wait(left)  # woken early by a new call: its deadline is computed again
                    continue
                armed.fired = True
                signal.pthread_kill(self.main, self.signum)
                self.cond.wait(_RESEND_S)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> tuple[bool, Any]:
        """``(in_time, value)``: ``fn(*args)``, and whether it ended within ``timeout_s``."""
        if self.armed is not None:  # nested in a timed call (a plugin calling a timed plugin): that call's deadline
            return True, fn(*args)  # bounds this one too; arming another would leave it unwatched once this one ends
        deadline = _Deadline(time.monotonic() + timeout_s)
        with self.cond:
            self.armed = deadline
            self.cond.notify()
        try:
            try:
                value = fn(*args)
            finally:
                self.armed = None  # one store, first: a signal handled after it raises nothing
        except DeadlineExceeded:  # in the call, or just before the store above
            self.armed = None
            return False, None
        except Exception:
            if deadline.fired:  # the function turned the interrupt into an error of its own: still the limit
                return False, None
            raise
        return not deadline.fired, value


_watchdog: Optional[_Watchdog] = None
_watchdog_lock = threading.Lock()


def _signal_number() -> Optional[int]:
    rtmin, rtmax = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
    if rtmin is None or rtmax is None or not hasattr(signal, "pthread_kill"):
        return None
    return min(int(rtmin) + 6, int(rtmax))


def main_thread_deadlines() -> bool:
    """Whether :func:`call_on_main_thread` can be used: this is the main thread, the platform has real-time
    signals, and the watchdog's signal is free (or already the watchdog's). Installs the watchdog on first use."""
    global _watchdog
    if threading.current_thread() is not threading.main_thread():
        return False
    with _watchdog_lock:
        if _watchdog is None:
            signum = _signal_number()
            if signum is None or signal.getsignal(signum) not in (signal.SIG_DFL, None):
                return False
            _watchdog = _Watchdog(signum)
        return signal.getsignal(_watchdog.signum) == _watchdog._on_signal


def call_on_main_thread(fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> tuple[bool, Any]:
    """``(in_time, value)`` of ``fn(*args)`` run on this (the main) thread under the watchdog: ``in_time`` False
    when the call was interrupted at its limit or ended after it (``value`` is then meaningless). Call only
    where :func:`main_thread_deadlines` is True. The function's own exceptions propagate."""
    assert _watchdog is not None
    return _watchdog.call(fn, args, timeout_s)


class _Call:
    """One call handed to a :class:`Worker`: its result or exception, and a lock released when it is done
    (a bare lock is the cheapest thing to wait on with a timeout)."""

    __slots__ = ("fn", "args", "value", "error", "done")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Lock()
        self.done.acquire()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, which raises it
            self.error = exc
        finally:
            self.args = ()  # the completion text is not kept alive by an abandoned call
            self.done.release()


class Worker:
    """A daemon thread running the calls handed to it, one at a time.

    Daemon, and not a ``concurrent.futures`` pool: the pool's threads are joined at interpreter exit, so a
    hung reward call would keep the process from exiting; an abandoned daemon thread never does.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Optional[_Call]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            call.run()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Call:
        call = _Call(fn, args)
        self._calls.put(call)
        return call

    def stop(self) -> None:
        """Let the thread end once its current call (if any, and if ever) returns."""
        self._calls.put(None)


def needs_main_thread(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) is the error of ``signal.signal`` / math-verify's timeouts
    off the main thread."""
    seen: set[int] = set()
    err: Optional[BaseException] = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if "only works in main thread" in text or "doesn't support threaded environment" in text:
            return True
        err = err.__cause__ or err.__context__
    return False
