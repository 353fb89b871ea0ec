"""Sequential safetensors writes with a running sha256.

:class:`SafetensorsWriter` takes the full list of ``(name, dtype, shape)`` up front (the converters know
every shape from the model config before reading a weight), writes the header, then appends tensors in
that order while hashing the bytes, so an output file is never held in memory and its sha256 costs no
second read; :func:`sha256_file` hashes a file already written. Files written here load with
``safetensors.safe_open`` / ``load_file`` and with transformers. The format and its header checks are
:mod:`megatron_logra.convert.st_header`; reading is :mod:`megatron_logra.convert.st_io`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO, Optional, Sequence, Union

import torch

from megatron_logra.convert.st_header import DTYPE_NAMES, _numel

__all__ = ["SafetensorsWriter", "sha256_file"]


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
