"""Setting the dotted fields of a config from the words of a command line, remembering which word set each field:
one field given twice with different values under two spellings is refused naming both, and a value that does not
parse names the flag that gave it (``--entropy-coef lots: rl.loss.entropy_coef='lots' is not a number``)."""

from __future__ import annotations

import math
from typing import Any, Optional

from megatron_logra.config.codec import _short
from megatron_logra.config.dotted import _canonical, _get_dotted, set_dotted
from megatron_logra.config.run import RunConfig

__all__ = ["FieldSetter"]


def _same_value(a: Any, b: Any) -> bool:
    """Whether two parsed field values are the same setting (NaN equals NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _spelled(spelling: str, value: Any) -> str:
    """``spelling`` with the parsed ``value`` it gave, unless the spelling shows it (``--bf16 (bfloat16)``)."""
    shown = value if isinstance(value, str) else _short(value)
    return spelling if str(shown) in spelling else f"{spelling} ({shown})"


def _spelling_key(spelling: str) -> str:
    """The key part of an override's spelling: ``--seq-length 64`` and ``seq-length=64`` -> ``seq-length``."""
    return spelling.split(" ", 1)[0].split("=", 1)[0].removeprefix("--")


class FieldSetter:
    """Sets dotted fields of a config, remembering which spelling set each one. One field set twice to different
    values under two spellings (``--tensor-model-parallel-size 2 parallel.tp=1``, ``logra.rank=8
    optimizer.logra.rank=4``, ``--bf16 model.params_dtype=float32``, ``--save A --load B``) is a ``ValueError``
    naming both; the same value twice is fine. The same key repeated (``rl.steps=5 ... rl.steps=7``, as when
    overrides are appended to a command line) sets the field to its last value."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.set_by: dict[str, tuple[str, Any]] = {}  # canonical field -> (spelling, parsed value)

    def put(self, key: str, raw: Any, spelling: str, flag: Optional[str] = None) -> None:
        """Set ``key`` (a dotted field or shortcut) from ``raw``, as ``spelling`` gave it; ``flag``: the
        context-dependent Megatron-LM flag (without ``--``) that resolved to ``key``, named in the error."""
        field = _canonical(key)
        before = self.set_by.get(field)
        try:
            set_dotted(self.cfg, key, raw)
        except ValueError as exc:  # a flag's value: say which word of the line gave it
            if _spelling_key(spelling) in (key, field):
                raise
            raise ValueError(f"{spelling}: {exc}") from exc
        value = _get_dotted(self.cfg, field)
        if before is None or _spelling_key(before[0]) == _spelling_key(spelling):
            self.set_by[field] = (spelling, value)
            return
        first, old = before
        if _same_value(old, value):
            return
        pair = f"as {_spelled(first, old)} and as {_spelled(spelling, value)}"
        hint = ""
        if field == "train.run_dir" and "load" in (_spelling_key(first), _spelling_key(spelling)):
            hint = (" (this trainer saves into the run directory it resumes from: --load DIR alone, or --resume DIR, "
                    "continues the run in DIR)")
        if flag is not None:
            raise ValueError(f"--{flag} sets {field} here, which is also given with another value, {pair}: give "
                             f"only one of them (or the same value){hint}")
        raise ValueError(f"{field} is set twice with different values, {pair}: both spell the same field; give it "
                         f"once{hint}")
