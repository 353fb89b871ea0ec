"""Custom reward functions loaded by dotted path.

A path is ``"package.module:function"`` or ``"package.module.function"`` (the last dot separates
the attribute); after a colon the attribute may itself be dotted (``"pkg.mod:Class.method"``).
The function is called as ``fn(problem, completion)`` and must return a real number in ``[0, 1]``
(1 = correct; :class:`~megatron_logra.rewards.task.Task` maps it to the configured rewards).
Every error names the path and what was wrong.

``slime:`` before either spelling names a slime reward function (``slime:package.module.function`` is how slime's
``--custom-rm-path`` is written): the same loader imports it, checked to take ``(args, sample)``;
:mod:`megatron_logra.rewards.slime_rm` calls it.

A call may be bounded in time (``task.reward_timeout_s``): :class:`PluginScorer` then raises
:class:`~megatron_logra.rewards.deadline.RewardTimeout` when it has not returned in time, rather than letting a
hung plugin (a code sandbox, an HTTP reward server, an endless loop) hang the run
(:mod:`megatron_logra.rewards.deadline`: how).
"""

from __future__ import annotations

import decimal
import importlib
import inspect
import logging
import math
import numbers
import re
import threading
from typing import Any, Callable, Optional

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.deadline import (RewardTimeout, Worker, call_on_main_thread, main_thread_deadlines,
                                               needs_main_thread)

__all__ = ["PluginScorer", "RewardTimeout", "SLIME_PREFIX", "is_dotted_path", "is_slime_path", "load_reward_fn"]

logger = logging.getLogger(__name__)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_PATH_RE = re.compile(rf"^(?:{_DOTTED}:{_DOTTED}|{_IDENT}(?:\.{_IDENT})+)$")

RewardFn = Callable[[Problem, str], float]

SLIME_PREFIX = "slime:"
"""What starts the path of a slime reward function (``task.reward=slime:package.module:function``)."""


def is_dotted_path(path: str) -> bool:
    """Whether ``path`` has the form ``pkg.module:function`` or ``pkg.module.function`` (not ``slime:...``, which
    :func:`is_slime_path` names)."""
    return isinstance(path, str) and not path.startswith(SLIME_PREFIX) and bool(_PATH_RE.match(path))


def is_slime_path(path: str) -> bool:
    """Whether ``path`` is ``slime:`` followed by a dotted path (a slime reward function)."""
    return isinstance(path, str) and path.startswith(SLIME_PREFIX) and is_dotted_path(path[len(SLIME_PREFIX):])


def _split(path: str) -> tuple[str, str]:
    if is_slime_path(path):
        path = path[len(SLIME_PREFIX):]
    elif not is_dotted_path(path):
        raise ValueError(
            f"reward function {path!r}: expected 'package.module:function' or 'package.module.function' "
            f"(Python identifiers separated by dots)"
        )
    if ":" in path:
        module, attr = path.split(":", 1)
    else:
        module, attr = path.rsplit(".", 1)
    return module, attr


def load_reward_fn(path: str) -> RewardFn:
    """Import and return the callable at ``path``; check it accepts ``(problem, completion)`` (a slime function
    at ``slime:...``: ``(args, sample)``).

    Raises ValueError naming ``path`` when the path is malformed, the module cannot be imported
    (or raises while importing), the attribute is missing, is not callable, or its signature
    cannot take two positional arguments.
    """
    module_name, attr = _split(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"reward function {path!r}: cannot import module {module_name!r} ({exc}); "
            f"is it installed or on sys.path / PYTHONPATH?"
        ) from exc
    except Exception as exc:
        raise ValueError(
            f"reward function {path!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ValueError(
                f"reward function {path!r}: {type(obj).__name__} {getattr(obj, '__name__', module_name)!r} "
                f"has no attribute {part!r} (callables in {module_name}: {', '.join(available[:10]) or 'none'})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {path!r}: {attr!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind(None, "")
    except TypeError as exc:
        raise ValueError(
            f"reward function {path!r}: must accept "
            f"{'(args, sample)' if is_slime_path(path) else '(problem, completion)'} positionally; "
            f"its signature is {inspect.signature(obj)} ({exc})"
        ) from exc
    except ValueError:  # builtins without a signature: trust them
        pass
    return obj  # type: ignore[return-value]


def _shown(number: numbers.Real) -> str:
    """``number`` for an error message: an integer too long for ``repr`` (past 4300 digits) by its size."""
    if isinstance(number, int) and abs(number).bit_length() > 1000:
        return f"an integer of about {int(abs(number).bit_length() * math.log10(2)) + 1} digits"
    return f"{number!r} ({type(number).__name__})"


class PluginScorer:
    """A :class:`~megatron_logra.rewards.base.Scorer` around a user reward function.

    The function's return value must be a finite real number in ``[0, 1]`` (``Fraction`` and ``Decimal`` too;
    bools count as 0/1; a numpy bool
    or scalar, a 0-d array or a one-element tensor counts as its ``.item()``); anything else raises ValueError
    naming the path and the value. Exceptions raised by the
    function propagate: a bug in user code should stop the run, not read as a wrong answer.

    ``timeout_s`` (``task.reward_timeout_s``; 0 or None: no limit, the function is simply called) bounds one
    call: past it, :class:`~megatron_logra.rewards.deadline.RewardTimeout`. On the main thread (the RL loop's)
    the function runs right there under a watchdog signal, so ``signal.alarm`` (math-verify's own timeouts)
    works in it as without a limit; elsewhere it runs on a daemon worker thread and a hung call is abandoned
    (:mod:`megatron_logra.rewards.deadline`). A timeout stops the run (the RL step turns it into a
    ``RewardError`` on every rank) rather than scoring the sample as wrong: a reward that cannot be computed is
    not a wrong answer, and silently training on it would hide a broken sandbox or reward server; the
    checkpoint before the step is intact. The limit cannot interrupt C code that holds the GIL (a backtracking
    ``re`` match): ``task.reward_workers`` scores in worker processes, whose calls it can stop
    (:mod:`megatron_logra.rewards.process_pool`). Concurrent callers are served one at a time.
    """

    _RANGE = (0.0, 1.0)
    """The values the function may return (a subclass whose function returns rewards widens it)."""
    _EXPECTED = "a number in [0, 1]"
    """What the function must return, for error messages."""

    def __init__(self, path: str, timeout_s: Optional[float] = None) -> None:
        self.path = path
        self.fn = self._load(path)
        self.timeout_s = float(timeout_s) if timeout_s else None
        self._worker: Optional[Worker] = None
        self._lock = threading.Lock()

    def _load(self, path: str) -> Callable[[Problem, str], Any]:
        """The callable :meth:`score` calls as ``fn(problem, completion)``: the function at ``path``."""
        return load_reward_fn(path)

    def __getstate__(self) -> dict[str, Any]:  # threads and locks do not copy: a copy starts its own worker
        state = dict(self.__dict__)
        state["_worker"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def score(self, problem: Problem, completion: str) -> float:
        """``fn(problem, completion)`` as a float in ``[0, 1]`` (``_RANGE``); :class:`RewardTimeout` past
        ``timeout_s``."""
        return self._checked(self._call(problem, completion))

    def _call(self, problem: Problem, completion: Any) -> Any:
        """``fn(problem, completion)``'s return value, within ``timeout_s`` where it is set
        (:meth:`_call_with_timeout`)."""
        if self.timeout_s is None:
            return self.fn(problem, completion)
        return self._call_with_timeout(problem, completion)

    def _checked(self, value: Any, where: str = "") -> float:
        """``value`` as a float in ``_RANGE``, else a ValueError naming the path, the value and ``where`` it was
        (`` at index 2 of its list``; empty: the function's return value itself)."""
        number = self._plain_number(value, where)
        try:
            value = float(number)
        except (OverflowError, ValueError, TypeError):  # an int past float's range (10**400): no float, no NaN
            raise ValueError(f"reward function {self.path!r} returned {_shown(number)}{where}; expected "
                             f"{self._EXPECTED}") from None
        if not math.isfinite(value) or not self._RANGE[0] <= value <= self._RANGE[1]:
            # a Decimal as itself: Decimal('1E+400') is no "inf"
            shown = _shown(number) if isinstance(number, decimal.Decimal) else repr(value)
            raise ValueError(f"reward function {self.path!r} returned {shown}{where}; expected {self._EXPECTED}")
        return value

    def _plain_number(self, value: Any, where: str = "") -> numbers.Real | decimal.Decimal:
        """``value`` as a real number: a Python or numpy real (``Fraction`` included) or a ``decimal.Decimal`` (no
        ``numbers.Real``, yet a real number: a NaN or infinite one is refused by the caller's range check) as it
        is; a numpy bool (``np.isclose(...)``) or another one-element numpy / torch value (a 0-d array or tensor) as
        its ``.item()``. Anything else, an array of several values or a complex number included, is a ValueError
        naming the path, the value and ``where`` (:meth:`_checked`)."""
        module = type(value).__module__.split(".")[0]
        has_item = callable(getattr(value, "item", None))
        if not isinstance(value, numbers.Real) and module in ("numpy", "torch") and has_item:
            count = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
            if count != 1:
                raise ValueError(f"reward function {self.path!r} returned {type(value).__name__} of {count} values"
                                 f"{where}; expected {self._EXPECTED} per completion")
            value = value.item()
        if not isinstance(value, (numbers.Real, decimal.Decimal)):
            raise ValueError(
                f"reward function {self.path!r} returned {value!r} ({type(value).__name__}){where}; "
                f"expected {self._EXPECTED}"
            )
        return value

    def _call_with_timeout(self, problem: Problem, completion: Any) -> Any:
        """The function's return value within ``timeout_s``: on this thread when it is the main thread, else on
        the worker thread."""
        assert self.timeout_s is not None
        if main_thread_deadlines():
            in_time, value = call_on_main_thread(self.fn, (problem, completion), self.timeout_s)
            if not in_time:
                raise self._timeout("the call was interrupted")
            return value
        with self._lock:
            if self._worker is None:
                self._worker = Worker(f"reward-fn {self.path}")
            call = self._worker.submit(self.fn, problem, completion)
            finished = False
            try:
                finished = call.done.acquire(timeout=self.timeout_s)
            finally:
                if not finished:  # timed out, or the wait itself was interrupted (KeyboardInterrupt)
                    self._abandon()
        if not finished:
            raise self._timeout("the call was abandoned (Python cannot stop a thread: it goes on in a daemon thread)")
        if call.error is not None:
            if needs_main_thread(call.error):
                raise ValueError(
                    f"reward function {self.path!r} needs the main thread ({type(call.error).__name__}: "
                    f"{call.error}): with task.reward_timeout_s={self.timeout_s:g} and called off the main thread, "
                    f"it runs on a worker thread, where signal.alarm is unavailable. Call math-verify with "
                    f"parsing_timeout=None / timeout_seconds=None (task.reward_timeout_s bounds the call), or set "
                    f"task.reward_timeout_s=0 to call the function on the caller's thread without a limit"
                ) from call.error
            raise call.error
        return call.value

    def _timeout(self, what: str) -> RewardTimeout:
        return RewardTimeout(
            f"reward function {self.path!r} did not return within {self.timeout_s:g} s "
            f"(task.reward_timeout_s={self.timeout_s:g}); {what}. Fix the function (a sandbox or HTTP call needs "
            f"its own timeout), or raise task.reward_timeout_s if it is merely slow (0 disables the limit)")

    def _abandon(self) -> None:
        """Leave the hung worker to finish (or not) on its own; the next call starts a fresh one."""
        if self._worker is not None:
            logger.warning("reward function %r: abandoning its call after %g s (task.reward_timeout_s); thread %r "
                           "goes on in the background", self.path, self.timeout_s, self._worker.thread.name)
            self._worker.stop()
            self._worker = None
