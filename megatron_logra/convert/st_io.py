"""Streaming safetensors I/O: validated headers, one-tensor reads, sequential writes with a running sha256.

The safetensors format is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces) and the tensor bytes, offsets relative to the end of the header.

* :func:`read_header` checks the header against the file size, so a truncated or padded
  file is rejected with a ``ValueError`` naming it before any tensor is read.
* :class:`TensorFile` reads one tensor at a time with ``seek`` + ``readinto`` (no mmap, no
  pickle): memory is that tensor only.
* :class:`SafetensorsWriter` takes the full list of ``(name, dtype, shape)`` up front (the
  converters know every shape from the model config before reading a weight), writes the
  header, then appends tensors in that order while hashing the bytes, so an output file
  is never held in memory and its sha256 costs no second read.

Files written here load with ``safetensors.safe_open`` / ``load_file`` and with transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import BinaryIO, Optional, Sequence, Union

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "TensorInfo", "read_header", "TensorFile", "SafetensorsWriter", "sha256_file"]

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


class TensorFile:
    """Read tensors of one safetensors file one at a time (the header is validated on open)."""

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self.tensors, self.metadata, self.data_start = read_header(self.path)
        self._f: Optional[BinaryIO] = None

    def read(self, name: str, out: Optional[torch.Tensor] = None,
             rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Tensor ``name`` (or only its rows ``[start, stop)`` along dim 0: one contiguous byte range);
        with ``out`` (contiguous, same dtype and element count) the bytes are read straight into
        ``out``'s memory, which is returned reshaped to the stored (row-sliced) shape."""
        info = self.tensors.get(name)
        if info is None:
            raise ValueError(f"{self.path}: no tensor {name!r}")
        shape, begin, nbytes = tuple(info.shape), info.begin, info.nbytes
        if rows is not None:
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"{self.path}: rows {rows} out of range for tensor {name!r} of shape {list(shape)}")
            row_bytes = nbytes // shape[0] if shape[0] else 0
            shape, begin, nbytes = (stop - start, *shape[1:]), begin + start * row_bytes, (stop - start) * row_bytes
        if out is None:
            out = torch.empty(shape, dtype=info.dtype)
        elif out.dtype != info.dtype or out.numel() != _numel(shape) or not out.is_contiguous():
            raise ValueError(f"{self.path}: tensor {name!r} is {info.dtype}{list(shape)}, cannot be read into a "
                             f"{'non-contiguous ' if not out.is_contiguous() else ''}{out.dtype}{list(out.shape)} buffer")
        if nbytes:
            if self._f is None:
                self._f = open(self.path, "rb")
            self._f.seek(self.data_start + begin)
            got = self._f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
            if got != nbytes:  # the file shrank after its header was checked
                raise ValueError(f"{self.path}: truncated while reading tensor {name!r} ({got} of {nbytes} bytes)")
        return out.view(shape)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class SafetensorsWriter:
    """Write a safetensors file whose tensors (names, dtypes, shapes, order) are known up front.

    ``write`` must be called once per entry in the declared order; ``close`` checks that every
    entry was written, then renames nothing (the caller owns atomicity) and returns
    ``{"sha256", "bytes", "num_tensors"}``. The file is opened on the first ``write``. An
    ``OSError`` of ``write`` / ``close`` (a full disk) names this file in its ``filename``.
    """

    def __init__(self, path: Union[str, Path], entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[dict[str, str]] = None):
        self.path = Path(path)
        self._entries = [(name, dtype, tuple(int(s) for s in shape)) for name, dtype, shape in entries]
        names = [e[0] for e in self._entries]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{self.path}: duplicate tensor names {dup}")
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in self._entries:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store here")
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._prefix = len(raw).to_bytes(8, "little") + raw
        self.data_bytes = offset
        self._next = 0
        self._f: Optional[BinaryIO] = None
        self._sha = hashlib.sha256()
        self._written = 0

    @property
    def done(self) -> bool:
        return self._next == len(self._entries)

    def _named(self, exc: OSError) -> OSError:
        """``exc`` with this file as its ``filename`` (a failed ``write`` or ``fsync`` does not name it)."""
        if exc.filename is None:
            exc.filename = str(self.path)
        return exc

    def _emit(self, data) -> None:
        assert self._f is not None
        try:
            self._f.write(data)
        except OSError as exc:  # a full disk: ENOSPC, EFBIG, EDQUOT
            raise self._named(exc)
        self._sha.update(data)
        self._written += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._entries):
            raise ValueError(f"{self.path}: unexpected tensor {name!r} (all {len(self._entries)} already written)")
        exp_name, dtype, shape = self._entries[self._next]
        if name != exp_name:
            raise ValueError(f"{self.path}: tensor {name!r} written out of order (expected {exp_name!r})")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, "
                             f"declared {dtype}{list(shape)}")
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "wb")
            self._emit(self._prefix)
        self._emit(_tensor_bytes(tensor))
        self._next += 1

    def close(self) -> dict:
        if not self.done:
            missing = [e[0] for e in self._entries[self._next:]]
            raise ValueError(f"{self.path}: closed with {len(missing)} tensors unwritten, first {missing[:3]}")
        if self._f is None:  # a file without tensors
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "wb")
            self._emit(self._prefix)
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except OSError as exc:  # buffered bytes that do not fit are reported here
            raise self._named(exc)
        self._f = None
        return {"sha256": self._sha.hexdigest(), "bytes": self._written, "num_tensors": len(self._entries)}

    def abort(self) -> None:
        """Close the file without the checks of :meth:`close` (the caller deletes it); never raises ``OSError``:
        flushing the bytes still buffered fails again on a full disk."""
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.close()
            except OSError:
                pass


def sha256_file(path: Union[str, Path], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()
