"""Dotted field names of a :class:`~megatron_logra.config.run.RunConfig` (``optimizer.logra.rank``): the
shortcuts (``logra.``, ``native.`` and ``schedule.`` for ``optimizer.logra.`` ...), a key's annotated type,
and :func:`set_dotted`, which sets one field from a command-line string or a YAML value parsed by that type
(:mod:`megatron_logra.config.codec`'s rules)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from megatron_logra.config.codec import _coerce, _is_section, _section_type
from megatron_logra.config.run import RunConfig
from megatron_logra.megatron_flags import MEGATRON_ALIASES

__all__ = ["set_dotted"]


_SHORTCUTS = {"logra.": "optimizer.logra.", "native.": "optimizer.native.", "schedule.": "optimizer.schedule."}


def _expand(key: str) -> str:
    for short, full in _SHORTCUTS.items():
        if key.startswith(short):
            return full + key[len(short):]
        if key == short[:-1]:  # the section itself ("logra" -> "optimizer.logra")
            return full[:-1]
    return key


def _canonical(key: str) -> str:
    """The dotted field ``key`` names, as :func:`set_dotted` spells it (shortcuts expanded, ``-`` -> ``_``)."""
    return _expand(key).replace("-", "_")


def _field_type(key: str) -> Any:
    """The annotated type of dotted ``key`` in :class:`RunConfig` (shortcuts and aliases applied), or None."""
    key = _expand(MEGATRON_ALIASES.get(key, key))
    cls: Any = RunConfig
    ftype: Any = None
    for part in key.split("."):
        if not _is_section(cls):
            return None
        hints = typing.get_type_hints(_section_type(cls))
        if part not in hints:
            return None
        ftype = cls = hints[part]
    return ftype


def _is_mapping_type(ftype: Any) -> bool:
    if typing.get_origin(ftype) is typing.Union:
        return any(_is_mapping_type(a) for a in typing.get_args(ftype))
    return ftype is dict or typing.get_origin(ftype) is dict


def set_dotted(cfg: Any, key: str, raw: Any) -> None:
    """Set ``cfg.<key>`` from ``raw`` (a command-line string, or a YAML value), parsed by the field's type."""
    key = _expand(key)
    parts = key.replace("-", "_").split(".")
    key = ".".join(parts)
    obj = cfg
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj):
            raise ValueError(f"unknown config key {key!r}: {'.'.join(parts[:i])} is not a section")
        names = {f.name for f in dataclasses.fields(obj)}
        if part not in names:
            where = ".".join(parts[:i]) or "the run config"
            close = difflib.get_close_matches(part, sorted(names), n=1)
            hint = f" (did you mean {'.'.join([*parts[:i], close[0]])}?)" if close else ""
            raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}{hint}; known: "
                             f"{sorted(names)}")
        if i == len(parts) - 1:
            ftype = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(raw, ftype, key))
        else:
            obj = getattr(obj, part)


def _get_dotted(cfg: Any, field: str) -> Any:
    """The value of the canonical dotted ``field`` of ``cfg``."""
    obj = cfg
    for part in field.split("."):
        obj = getattr(obj, part)
    return obj
