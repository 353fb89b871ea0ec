"""Reading a full-weights file: verified first, then streamed one tensor at a time.

Owns :class:`FullWeightsReader`, the consumer's side of :mod:`megatron_logra.sync.full_weights`: it checks the
header against the format (:mod:`megatron_logra.sync.full_weights_format`), the version and the sha256 the
anchor marker names over every byte before any tensor is handed out, then reads each tensor with ``seek`` +
``readinto`` so that no file is held in memory whole. Importable from :mod:`megatron_logra.sync.full_weights`.

Imports only torch and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights_format import (_FULL_FORMAT, _FULL_MAGIC, _FULL_META, _FULL_META_SHA, _ST_TORCH,
                                                     _numel)
from megatron_logra.sync.layout import VOCAB_PARALLEL


_READ_CHUNK = 1 << 24


class FullWeightsReader:
    """An opened, checksum-verified full-weights file, held open while it is read. On a local POSIX
    filesystem a producer replacing or pruning it meanwhile does not change what is read; on NFS a file
    another node deletes (a newer refit replacing it) may fail to read with ``ESTALE``: :meth:`tensors`
    then raises ``SyncError("unreadable")`` and an engine that had copied some tensors is at
    ``weight_version = -1`` (``ModuleEngine.update_weights_full``), to be reloaded from the newest anchor."""

    def __init__(self, path: Path, version: int, sha256: Optional[str]) -> None:
        self.path = path
        self.anchor: Optional[dict] = None  # the marker it was opened for (DirectoryTransport.open_full)
        try:
            self._fh = open(path, "rb")
        except OSError as exc:
            raise SyncError("unreadable", f"{path.name}: cannot be read ({type(exc).__name__}: {exc.strerror}); a "
                                          "newer refit may have replaced it: reload the newest anchor") from None
        try:
            self._parse(version, sha256)
        except BaseException:
            self._fh.close()
            raise

    def _bad(self, what: str) -> SyncError:
        return SyncError("malformed", f"{self.path.name}: {what}")

    def _parse(self, version: int, sha256: Optional[str]) -> None:
        size = os.fstat(self._fh.fileno()).st_size
        prefix = self._fh.read(8)
        if len(prefix) < 8:
            raise SyncError("truncated", f"{self.path.name}: shorter than the 8-byte safetensors prefix")
        (n,) = struct.unpack("<Q", prefix)
        if 8 + n > size:
            raise SyncError("truncated", f"{self.path.name}: the header claims {n} bytes, {size - 8} follow")
        try:
            st = json.loads(self._fh.read(n))
            meta = st.pop("__metadata__")
            header = json.loads(meta[_FULL_META])
            claimed = meta[_FULL_META_SHA]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._bad(f"not a full-weights file ({type(exc).__name__})") from None
        if not isinstance(header, dict) or header.get("format") != _FULL_FORMAT:
            raise self._bad(f"format {header.get('format') if isinstance(header, dict) else None!r}, "
                            f"expected {_FULL_FORMAT!r}")
        if header.get("version") != version:
            raise self._bad(f"holds version {header.get('version')!r}, expected {version}")
        dtype = _ST_TORCH.get(header.get("dtype"))
        if dtype is None or header.get("tensors") != len(st):
            raise self._bad("header does not describe the tensors")
        vocab_rows = header.get("vocab_rows")
        if vocab_rows is not None and (isinstance(vocab_rows, bool) or not isinstance(vocab_rows, int)
                                       or vocab_rows < 1):
            raise self._bad(f"vocab_rows {vocab_rows!r} is not a row count")
        entries = []
        try:
            for name, info in st.items():
                if info["dtype"] != header["dtype"]:
                    raise self._bad(f"{name} is {info['dtype']}, the file is {header['dtype']}")
                shape = [int(x) for x in info["shape"]]
                start, stop = (int(x) for x in info["data_offsets"])
                entries.append((start, stop, name, shape))
        except (KeyError, TypeError, ValueError) as exc:
            raise self._bad(f"malformed tensor entry ({exc!r})") from None
        entries.sort()
        elem, at = torch.empty((), dtype=dtype).element_size(), 0
        for start, stop, name, shape in entries:
            if start != at or stop - start != elem * _numel(shape):
                raise self._bad(f"{name}: data offsets [{start}, {stop}) do not follow the previous tensor")
            at = stop
        if 8 + n + at != size:
            raise SyncError("truncated" if 8 + n + at > size else "malformed",
                            f"{self.path.name}: {size - 8 - n} data bytes, the header describes {at}")
        for start, stop, name, shape in entries:
            if name in VOCAB_PARALLEL and shape and vocab_rows is not None and shape[0] != vocab_rows:
                raise self._bad(f"{name} has {shape[0]} rows, the header says vocab_rows {vocab_rows}")
        self.version, self.dtype, self.data_start, self.vocab_rows = version, dtype, 8 + n, vocab_rows
        self.entries = [(name, shape, start, stop) for start, stop, name, shape in entries]
        h = hashlib.sha256(_FULL_MAGIC + meta[_FULL_META].encode())
        for name, shape, start, stop in self.entries:  # pass 1: the checksum, in chunks
            h.update(f"|{name}|{dtype}|{shape}|".encode())
            self._fh.seek(self.data_start + start)
            left = stop - start
            while left:
                chunk = self._fh.read(min(left, _READ_CHUNK))
                if not chunk:
                    raise SyncError("truncated", f"{self.path.name}: ends inside {name}")
                h.update(chunk)
                left -= len(chunk)
        if h.hexdigest() != claimed:
            raise SyncError("checksum", f"{self.path.name}: sha256 mismatch (the file says {str(claimed)[:16]}…, its "
                                        f"content hashes to {h.hexdigest()[:16]}…)")
        if sha256 is not None and claimed != sha256:
            raise SyncError("anchor", f"{self.path.name} is not the file of this anchor (sha256 {claimed[:16]}…, the "
                                      f"marker names {sha256[:16]}…): a newer refit replaced it; reload the newest "
                                      "anchor")

    def shapes(self) -> dict[str, list[int]]:
        return {name: shape for name, shape, _, _ in self.entries}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` in file order, one tensor in memory at a time (fresh CPU tensors)."""
        for name, shape, start, stop in self.entries:
            if stop == start:
                yield name, torch.empty(shape, dtype=self.dtype)
                continue
            buf = bytearray(stop - start)
            try:
                self._fh.seek(self.data_start + start)
                got = self._fh.readinto(buf)
            except OSError as exc:
                raise SyncError("unreadable", f"{self.path.name}: reading {name} failed ({type(exc).__name__}: "
                                              f"{exc.strerror}); a newer refit may have replaced it: reload the "
                                              "newest anchor") from None
            if got != len(buf):
                raise SyncError("truncated", f"{self.path.name}: ends inside {name}")
            yield name, torch.frombuffer(buf, dtype=self.dtype).reshape(shape)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "FullWeightsReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
