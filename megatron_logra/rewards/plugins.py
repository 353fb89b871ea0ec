"""Custom reward functions loaded by dotted path.

A path is ``"package.module:function"`` or ``"package.module.function"`` (the last dot separates
the attribute); after a colon the attribute may itself be dotted (``"pkg.mod:Class.method"``).
The function is called as ``fn(problem, completion)`` and must return a real number in ``[0, 1]``
(1 = correct; :class:`~megatron_logra.rewards.task.Task` maps it to the configured rewards).
Every error names the path and what was wrong.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
import re
from typing import Callable

from megatron_logra.rewards.base import Problem

__all__ = ["PluginScorer", "is_dotted_path", "load_reward_fn"]

logger = logging.getLogger(__name__)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_PATH_RE = re.compile(rf"^(?:{_DOTTED}:{_DOTTED}|{_IDENT}(?:\.{_IDENT})+)$")

RewardFn = Callable[[Problem, str], float]


def is_dotted_path(path: str) -> bool:
    """Whether ``path`` has the form ``pkg.module:function`` or ``pkg.module.function``."""
    return bool(_PATH_RE.match(path))


def _split(path: str) -> tuple[str, str]:
    if not is_dotted_path(path):
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
    """Import and return the callable at ``path``; check it accepts ``(problem, completion)``.

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
            f"reward function {path!r}: must accept (problem, completion) positionally; "
            f"its signature is {inspect.signature(obj)} ({exc})"
        ) from exc
    except ValueError:  # builtins without a signature: trust them
        pass
    return obj  # type: ignore[return-value]


class PluginScorer:
    """A :class:`~megatron_logra.rewards.base.Scorer` around a user reward function.

    The function's return value must be a finite real number in ``[0, 1]`` (bools count as 0/1);
    anything else raises ValueError naming the path and the value. Exceptions raised by the
    function propagate: a bug in user code should stop the run, not read as a wrong answer.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fn = load_reward_fn(path)

    def score(self, problem: Problem, completion: str) -> float:
        """``fn(problem, completion)`` as a float in ``[0, 1]``."""
        value = self.fn(problem, completion)
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"reward function {self.path!r} returned {value!r} ({type(value).__name__}); "
                f"expected a number in [0, 1]"
            )
        value = float(value)
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"reward function {self.path!r} returned {value!r}; expected a number in [0, 1]")
        return value
