"""The safetensors format: its dtype names and the validated reading of a file's header.

The format is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces) and the tensor bytes, offsets relative to the end of the header.
:func:`read_header` checks the header against the file size, so a truncated or padded file is rejected
with a ``ValueError`` naming it before any tensor is read.

This module owns what both directions share (the dtype table, sizes from shapes) and the header checks;
the tensor reads are :mod:`megatron_logra.convert.st_io`, the writes :mod:`megatron_logra.convert.st_write`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence, Union

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "TensorInfo", "read_header"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("megatron_logra.convert needs a little-endian host (safetensors stores little-endian bytes)")


class TensorInfo:
    """One tensor's entry in a safetensors header."""

    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"TensorInfo({self.name!r}, {self.dtype}, {self.shape}, [{self.begin}, {self.end}])"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _is_count(x) -> bool:
    """A JSON non-negative integer (``bool`` is an ``int`` subclass in Python, not in JSON)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _short(value, limit: int = 80) -> str:
    """``repr`` of a header value, cut to ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_header(path: Union[str, Path]) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """``(tensors, metadata, data_start)`` of a safetensors file, fully validated.

    ``ValueError`` naming the file when it is shorter than its header says (truncated), has
    trailing bytes, an unreadable header, an unknown dtype, or offsets that do not tile the
    data section exactly. Field types are checked as strictly as the safetensors library does,
    the message naming the field: ``__metadata__`` absent, ``null`` or an object of string ->
    string; each tensor entry an object whose ``dtype`` is a string, ``shape`` a list of
    non-negative integers and ``data_offsets`` a list of two non-negative integers (``4.9``,
    ``"4"`` and ``true`` are not integers).
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, shorter than the 8-byte header length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: corrupt safetensors file (header length {n} is implausible)")
        if 8 + n > size:
            raise ValueError(f"{path}: truncated safetensors file (header needs {8 + n} bytes, the file has {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError(f"{path}: corrupt safetensors header (__metadata__ must be an object of string -> string, "
                         f"got {_short(metadata)})")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: not an object "
                             f"({_short(entry)})")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: no {field!r} "
                                 f"({_short(entry)})")
        dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype_name, str):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: dtype must be a string, "
                             f"got {_short(dtype_name)}")
        if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: shape must be a list of "
                             f"non-negative integers, got {_short(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: data_offsets must be a "
                             f"list of two non-negative integers [begin, end], got {_short(offsets)}")
        shape, (begin, end) = tuple(shape), offsets
        if dtype_name not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype_name}, which this converter does not read")
        dtype = DTYPES[dtype_name]
        expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {[begin, end]} inconsistent with "
                             f"{dtype_name}{list(shape)} ({expected} bytes)")
        tensors[name] = TensorInfo(name, dtype, shape, begin, end)
    cursor = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != cursor:
            raise ValueError(f"{path}: corrupt safetensors file (tensor {info.name!r} starts at {info.begin}, "
                             f"expected {cursor}: overlapping or gapped data)")
        cursor = info.end
    data_start = 8 + n
    if data_start + cursor > size:
        raise ValueError(f"{path}: truncated safetensors file (the header describes {data_start + cursor} bytes, "
                         f"the file has {size})")
    if data_start + cursor < size:
        raise ValueError(f"{path}: corrupt safetensors file ({size - data_start - cursor} bytes after the last tensor)")
    return tensors, dict(metadata), data_start
