"""Byte sizes: parse ``80GiB`` / ``141GB`` / ``80 GiB`` / ``1.5e9`` and format them back.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (kB, KB, MB, GB, TB)
powers of 1000. Vendors' names are closer to binary sizes: an "80 GB" H100 reports
81559 MiB (79.6 GiB) to nvidia-smi and a "141 GB" H200 143771 MiB (140.4 GiB), so give
the planner ``81559MiB`` / ``143771MiB`` (or ``80GiB`` / ``140GiB``) for those cards.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Union

logger = logging.getLogger(__name__)

__all__ = ["parse_bytes", "format_bytes", "KiB", "MiB", "GiB", "TiB", "GB"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
GB = 1000**3

_SUFFIXES = {
    "": 1, "b": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": GB, "gb": GB, "t": 1000**4, "tb": 1000**4,
}
_MAX_BYTES = 1e24  # a yottabyte: anything larger is a typo (and 1e400 would overflow)
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _label(name: str, value: object) -> str:
    """``--gpu-memory 80`` for a command-line option, ``gpu_memory='80'`` for a field."""
    return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"


def parse_bytes(value: Union[str, int, float], *, name: str = "size", require_unit: bool = False) -> int:
    """Bytes of ``value``: an int, or a string like ``80GiB``, ``141GB``, ``512 MiB``, ``1.5e9``.

    With ``require_unit`` a string must carry its unit (``80`` is refused as "80 bytes?"; ``80B`` is fine,
    and so is a bare ``0``). Raises ``ValueError`` naming ``name`` (a field, or an option such as
    ``--gpu-memory``) for anything else: negative, unknown unit, empty, too large.
    """
    label = _label(name, value)
    if isinstance(value, bool):
        raise ValueError(f"{label} is not a size: give bytes or a number with a unit such as 80GiB or 141GB")
    if isinstance(value, (int, float)):
        if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
            raise ValueError(f"{label} must be a finite, non-negative number of bytes")
        if value > _MAX_BYTES:
            raise ValueError(f"{label} is too large (more than {_MAX_BYTES:.0e} bytes)")
        return int(value)
    match = _PATTERN.match(str(value))
    if not match:
        raise ValueError(f"{label} is not a size: give bytes or a number with a unit such as 80GiB or 141GB")
    number, unit = match.groups()
    factor = _SUFFIXES.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"{label}: unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)"
        )
    amount = float(number) * factor
    if not math.isfinite(amount) or amount > _MAX_BYTES:
        raise ValueError(f"{label} is too large (more than {_MAX_BYTES:.0e} bytes); give a size such as 80GiB")
    if require_unit and not unit and amount != 0:
        raise ValueError(
            f"{label}: give a unit, e.g. {number}GiB or {number}GB ({number} bytes? write {number}B; "
            f"an \"80 GB\" H100 is 81559MiB)"
        )
    return int(round(amount))


def format_bytes(n: Union[int, float], *, unit: str = "GiB", digits: int = 2) -> str:
    """``n`` bytes as a string in ``unit`` (GiB by default; ``auto`` picks B/KiB/MiB/GiB)."""
    if unit == "auto":
        for u, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if abs(n) >= f:
                return f"{n / f:.{digits}f} {u}"
        return f"{int(n)} B"
    factor = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "GB": GB}.get(unit)
    if factor is None:
        raise ValueError(f"unit={unit!r}: choose B, KiB, MiB, GiB, TiB, GB or auto")
    return f"{n / factor:.{digits}f} {unit}"
