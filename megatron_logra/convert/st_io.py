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

This module owns the tensor reads (:class:`TensorFile`) and is the import path of all three; the format and
:func:`read_header` live in :mod:`megatron_logra.convert.st_header`, the writer and :func:`sha256_file` in
:mod:`megatron_logra.convert.st_write`.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Optional, Union

import torch

from megatron_logra.convert.st_header import DTYPE_NAMES, DTYPES, TensorInfo, _numel, read_header
from megatron_logra.convert.st_write import SafetensorsWriter, sha256_file

__all__ = ["DTYPES", "DTYPE_NAMES", "TensorInfo", "read_header", "TensorFile", "SafetensorsWriter", "sha256_file"]


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


