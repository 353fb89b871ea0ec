"""Typed readers of the fields of a Hugging Face ``config.json`` (and of any JSON object file).

Each reader takes a field as the JSON type it must be (a positive integer, a boolean, a positive finite number)
and refuses anything else (null, a string, a bool for a number) with a ``ValueError`` naming the field and the
file, never reading a value by truthiness, as transformers refuses them too. Shared by the presets loader
(:mod:`megatron_logra.models.presets`), the RoPE fields (:mod:`megatron_logra.models.hf_rope`) and the convert
checks; the public names stay importable from :mod:`megatron_logra.models.presets`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional


def _require(raw: dict, key: str, source: str) -> int:
    if key not in raw:
        raise ValueError(f"{source}: the field {key!r} is missing (needed for the model shape)")
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
    return value


def _optional_int(raw: dict, key: str, source: str) -> Optional[int]:
    """``raw[key]`` as a positive integer, ``None`` when absent or null; ``ValueError`` naming the field otherwise."""
    value = raw.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{source}: {key}={value!r} must be a positive integer (or be left out)")
    return value


def hf_bool(raw: dict, key: str, default: bool, source: str) -> bool:
    """``raw[key]`` as a JSON boolean, ``default`` when absent. A string (``"false"``), number or null is a
    ``ValueError`` naming the field and ``source``, never read by truthiness (transformers refuses them too)."""
    if key not in raw:
        return default
    value = raw[key]
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key}={value!r} must be true or false (a JSON boolean, not a string or null)")
    return value


def _positive_number(raw: dict, key: str, default: float, source: str, label: str = "") -> float:
    """``raw[key]`` as a positive finite number, ``default`` when absent; ``ValueError`` naming the field
    (``label`` + ``key``) otherwise."""
    if key not in raw:
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {label}{key}={value!r} must be a positive number (a JSON number such as 1e-06, "
                         "not a string or null)")
    return float(value)


def read_json_object(path: Path, *, prefix: str = "") -> dict:
    """The JSON object stored in ``path``; ``ValueError`` (``prefix`` + path) if it is not valid JSON or not an object."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{prefix}{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{prefix}{path}: does not hold a JSON object")
    return raw
