"""A run config to and from a plain dict (:func:`to_dict`, :func:`from_dict`: what ``config.yaml`` in a run
directory holds), and the parsing of one value by its field's annotated type.

:func:`from_dict` checks a saved config's values as the command line does, so the rules for one value
(``_parse_value`` for command-line strings, ``_coerce`` for YAML / JSON values, the section helpers) live
here and the dotted overrides (:mod:`megatron_logra.config.dotted`, :mod:`megatron_logra.config.overrides`)
and the Megatron-LM flags (:mod:`megatron_logra.megatron_flags`) reuse them. This module imports no other
config module.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Sequence

__all__ = ["to_dict", "from_dict"]


def to_dict(cfg: Any) -> dict:
    """``cfg`` (a :class:`~megatron_logra.config.run.RunConfig` or any config dataclass) as a nested dict of
    plain values, what a run directory's ``config.yaml`` holds; :func:`from_dict` builds it back."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict, _prefix: str = "", *, validate: bool = True) -> Any:
    """Build dataclass ``cls`` from a (possibly partial) nested dict; unknown keys are errors.

    ``validate=False`` builds it without running any ``__post_init__`` check (only the fields' types are
    checked): for a saved config that command-line overrides may still fix; call ``validate()`` (or
    :func:`megatron_logra.config.overrides.apply_overrides`, which does) before using it.

    Values are checked against the fields' types as the dotted overrides are: strings parse like the command
    line (``"32"`` -> 32, ``"1e-4"`` -> 1e-4), other values must already have the field's type (ints widen to
    floats), and a section (a dataclass-typed field) takes a mapping, never a value. Errors are ``ValueError``
    naming the dotted field.
    """
    if not isinstance(data, dict):
        where = _prefix.rstrip(".") or "the config"
        raise ValueError(f"{where} must be a mapping of {cls.__name__} fields, got {type(data).__name__} "
                         f"{_short(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        where = f" (in {_prefix.rstrip('.')})" if _prefix else ""
        raise ValueError(f"unknown {cls.__name__} fields {unknown}{where}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        ftype, path = hints[key], f"{_prefix}{key}"
        if _is_section(ftype) and isinstance(value, dict):
            kwargs[key] = from_dict(_section_type(ftype), value, f"{path}.", validate=validate)
        else:
            kwargs[key] = _coerce(value, ftype, path)
    if validate:
        return cls(**kwargs)
    obj = cls.__new__(cls)  # the fields as given, the rest at their defaults; no __post_init__
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ValueError(f"{_prefix}{f.name} is missing ({cls.__name__} has no default for it)")
        object.__setattr__(obj, f.name, value)
    return obj


# ---------------------------------------------------------------------------- values by annotated type
def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _section_type(ftype: Any) -> Any:
    """The dataclass of a section type (``X`` or ``Optional[X]``), else None."""
    if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
        return ftype
    if typing.get_origin(ftype) is typing.Union:
        for a in typing.get_args(ftype):
            if isinstance(a, type) and dataclasses.is_dataclass(a):
                return a
    return None


def _is_section(ftype: Any) -> bool:
    return _section_type(ftype) is not None


def _section_error(key: str, ftype: Any, value: Any) -> ValueError:
    cls = _section_type(ftype)
    fields = sorted(f.name for f in dataclasses.fields(cls))
    return ValueError(
        f"{key}={_short(value)}: {key} is a section ({cls.__name__}), not a single value; set its fields "
        f"with {key}.<field>=... (in YAML, a mapping under '{key.rsplit('.', 1)[-1]}:'); fields: {fields}"
    )


def _parse_value(raw: str, ftype: Any, key: str) -> Any:
    origin = typing.get_origin(ftype)
    args = typing.get_args(ftype)
    if origin is typing.Union and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _parse_value(raw, inner, key)
    if ftype is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={raw!r} is not a boolean (use true/false)")
    if ftype is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not an integer") from None
    if ftype is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not a number") from None
    if origin in (list, Sequence) or ftype is list:
        inner = args[0] if args else str
        body = raw.strip()
        if body.startswith("[") and body.endswith("]"):  # YAML/JSON flow style: [a, b]
            body = body[1:-1]
        return [_parse_value(s.strip().strip("'\""), inner, key) for s in body.split(",") if s.strip()]
    if origin is dict or ftype is dict:
        import json

        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{key}={raw!r} is not a JSON object ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{key}={raw!r} is not a JSON object")
        return value
    return raw


def _coerce(value: Any, ftype: Any, key: str) -> Any:
    """``value`` from YAML / JSON for a field of type ``ftype``: strings parse as on the command line; other
    values must already have the field's type (ints widen to floats, 0/1 read as booleans)."""
    if _is_section(ftype):
        raise _section_error(key, ftype, value)
    if isinstance(value, str):
        return _parse_value(value, ftype, key)
    origin = typing.get_origin(ftype)
    args = typing.get_args(ftype)
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(value, inner, key)
    if ftype is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{key}={_short(value)} is not a boolean (use true/false)")
    if ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{key}={_short(value)} is not an integer")
    if ftype is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{key}={_short(value)} is not a number")
    if ftype is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key}={_short(value)} is not a string (quote it in YAML)")
    if origin in (list, Sequence) or ftype is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}={_short(value)} is not a list (give [a, b] or a,b)")
        inner = args[0] if args else Any
        return [v if inner is Any else _coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or ftype is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={_short(value)} is not a mapping (give a JSON object / YAML mapping)")
        return value
    return value
