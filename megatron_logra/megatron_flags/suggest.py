"""Every Megatron-LM flag name of the tables, and the error for a ``--name`` that no table knows, naming the
closest flags and config fields.

An unknown ``--name`` never takes the next argument as its value: it is refused here rather than guessed at.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from megatron_logra.megatron_flags.mapped import (CHECK_FLAGS, JOB_ALIASES, LOAD_FLAGS, MEGATRON_ALIASES,
                                                  MEGATRON_FLAGS, OPTIMIZER_ALIASES, SCHEDULE_RATIO_FLAGS,
                                                  STEP_FRACTION_FLAGS, VALUE_MAPS)
from megatron_logra.megatron_flags.unmapped import (IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, NEUTRAL_FLAGS,
                                                    REFUSED_SWITCHES, REFUSED_VALUE_FLAGS)

# _dotted_fields imports megatron_logra.config's modules when called: that package imports this package while
# it loads

__all__ = ["known_flags", "suggestions", "unknown_flag_error"]


def known_flags() -> list[str]:
    """Every Megatron-LM flag name (without ``--``) of the tables of :mod:`~megatron_logra.megatron_flags`,
    sorted."""
    names: set[str] = set()
    for table in (MEGATRON_ALIASES, JOB_ALIASES, OPTIMIZER_ALIASES, SCHEDULE_RATIO_FLAGS, STEP_FRACTION_FLAGS,
                  CHECK_FLAGS, LOAD_FLAGS, MEGATRON_FLAGS, IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, NEUTRAL_FLAGS,
                  REFUSED_SWITCHES, REFUSED_VALUE_FLAGS, VALUE_MAPS):
        names.update(table)
    return sorted(names)


def _dotted_fields(cls: Any = None, prefix: str = "") -> list[str]:
    """Every dotted leaf field of the config dataclass ``cls`` (default: the run config)."""
    from megatron_logra.config.codec import _section_type
    from megatron_logra.config.run import RunConfig

    cls = RunConfig if cls is None else cls
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = _section_type(hints[f.name])
        if section is not None:
            out.extend(_dotted_fields(section, f"{prefix}{f.name}."))
        else:
            out.append(f"{prefix}{f.name}")
    return out


def suggestions(name: str, limit: int = 3) -> list[str]:
    """The known spellings closest to ``name`` (a flag name without ``--``, or a dotted key): ``--FLAG`` for a
    Megatron-LM flag, the dotted field otherwise; best first, at most ``limit``, empty when nothing is close."""
    under = name.replace("-", "_")
    scored: list[tuple[float, str]] = []
    for flag in known_flags():
        scored.append((difflib.SequenceMatcher(None, name, flag).ratio(), f"--{flag}"))
    for field in _dotted_fields():
        leaf = field.rsplit(".", 1)[-1]
        ratio = max(difflib.SequenceMatcher(None, under, field).ratio(),
                    difflib.SequenceMatcher(None, under, leaf).ratio())
        scored.append((ratio, field))
    scored.sort(key=lambda s: -s[0])
    return [spelling for ratio, spelling in scored if ratio >= 0.7][:limit]


def unknown_flag_error(flag: str) -> ValueError:
    """The error for ``--flag`` that no table knows and that is no dotted field: names it and the closest
    flags and fields."""
    close = suggestions(flag)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return ValueError(f"unknown option --{flag}: it is neither a Megatron-LM or slime flag this trainer accepts nor "
                      f"a config field; {hint}`megatron-logra train --help` lists the flags, `megatron-logra config "
                      f"RECIPE` every field (give a field as a.b=VALUE or --a.b VALUE)")
