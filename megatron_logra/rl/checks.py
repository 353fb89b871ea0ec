"""Validation shared by the RL job's config dataclasses (standard library only)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["check_finite_fields"]


def check_finite_fields(prefix: str, obj: Any) -> None:
    """Refuse nan / inf in the float fields of the dataclass ``obj`` (``ValueError`` naming ``prefix.field``):
    no float setting of the RL job means anything at nan or inf, and most comparisons pass nan silently, so
    each config calls this before its range checks."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type in ("float", float) and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{prefix}.{f.name}={value} must be a finite number (not nan or inf): set a finite value "
                             f"(default {f.default})")
