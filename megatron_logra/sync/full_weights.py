"""Full-weights files: a refit's whole weights on disk, written and read one tensor at a time.

A trainer's full refit (anchor, re-anchor, drift repair) writes ``full_{version:08d}.safetensors``
next to its anchor marker (:class:`~megatron_logra.sync.transport.DirectoryTransport`), so a consumer
that cannot follow the delta chain reloads from it. :class:`FullWeightsWriter` writes it tensor by tensor
(atomically: temporary file, fsync, rename); :class:`FullWeightsReader` verifies and streams it.

The file is safetensors (no pickle): every tensor in HF names, in one dtype (the engine's), the
vocabulary-parallel ``embed_tokens``/``lm_head`` at the model's vocabulary (``model.vocab_size``
rows, as in its HF checkpoint, without the trainer's padding rows), and the metadata ``logra.full``
(canonical JSON ``{"format", "version", "dtype", "tensors"}``, plus ``"vocab_rows"`` when the file
holds a vocabulary-parallel tensor) and ``logra.full.sha256``: sha256 over
``b"logra-full-weights|"``, that JSON, and then for every tensor in data order
``|name|dtype|shape|`` and its raw bytes. Those names and constants live in
:mod:`megatron_logra.sync.full_weights_format`, the reader in :mod:`megatron_logra.sync.full_weights_reader`
(both importable from here).

Imports only torch and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights_format import (_FULL_FORMAT, _FULL_MAGIC, _FULL_META, _FULL_META_SHA, _PLACEHOLDER,
                                                     _ST_DTYPES, _numel, full_filename)
from megatron_logra.sync.full_weights_reader import FullWeightsReader
from megatron_logra.sync.layout import VOCAB_PARALLEL

logger = logging.getLogger(__name__)

__all__ = ["FullWeightsWriter", "FullWeightsReader", "full_filename", "fsync_dir"]


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename into it survives a crash (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class FullWeightsWriter:
    """Writes one full-weights file ``full_<version>.safetensors`` tensor by tensor (see
    :meth:`~megatron_logra.sync.transport.DirectoryTransport.full_writer`; the module docstring describes the file).

    Holds one tensor at a time: the safetensors header is written first from the declared
    ``specs`` (every name and shape, in the order the tensors will come), the data follows as
    :meth:`add` receives it, and :meth:`finish` writes the sha256 into the header's reserved slot,
    fsyncs and renames the temporary file into place. :meth:`add` never raises: a tensor out of
    order, of another shape, or a failed write marks the file failed, and :meth:`finish` then
    deletes it and returns None (logging why), so a caller streaming the tensors to an engine at
    the same time is never interrupted.

    ``vocab_rows``: the model's vocabulary (``model.vocab_size``). The vocabulary-parallel tensors
    (``model.embed_tokens.weight``, ``lm_head.weight``) are declared and added as the trainer streams them
    (padded rows included) and written as their first ``vocab_rows`` rows, the tensors of the model's HF
    checkpoint, which an engine started from it holds. None writes them as they come. The header records the
    row count written (``vocab_rows``) whenever the file holds such a tensor.
    """

    def __init__(self, directory: Path, version: int, specs: Sequence[tuple[str, Sequence[int]]],
                 dtype: torch.dtype, vocab_rows: Optional[int] = None) -> None:
        if dtype not in _ST_DTYPES:
            raise SyncError("dtype", f"full weights are written in one of {sorted(map(str, _ST_DTYPES))}, got {dtype}")
        self.version, self.dtype = int(version), dtype
        self.final = directory / full_filename(self.version)
        self.tmp = directory / f".{self.final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        self._specs = [(str(n), [int(x) for x in shape]) for n, shape in specs]
        self._next = 0
        self.error: Optional[str] = None
        if len({n for n, _ in self._specs}) != len(self._specs):
            raise SyncError("keys", f"{self.final.name}: a tensor name is listed twice")
        if vocab_rows is not None and (isinstance(vocab_rows, bool) or not isinstance(vocab_rows, int)
                                       or vocab_rows < 1):
            raise SyncError("config", f"vocab_rows={vocab_rows!r} must be an int >= 1 (the model's vocabulary)")
        self._rows: dict[str, int] = {}  # vocabulary-parallel name -> rows written
        for name, shape in self._specs:
            if name in VOCAB_PARALLEL and shape:
                if vocab_rows is not None and vocab_rows > shape[0]:
                    raise SyncError("shape", f"{self.final.name}: {name} has {shape[0]} rows, fewer than the "
                                             f"vocabulary of {vocab_rows}")
                self._rows[name] = shape[0] if vocab_rows is None else vocab_rows
        self._file_shapes = [[self._rows[n], *shape[1:]] if n in self._rows else shape for n, shape in self._specs]
        header = {"format": _FULL_FORMAT, "version": self.version, "dtype": _ST_DTYPES[dtype],
                  "tensors": len(self._specs)}
        if len(set(self._rows.values())) > 1:
            raise SyncError("shape", f"{self.final.name}: the vocabulary-parallel tensors have different row "
                                     f"counts {self._rows}")
        if self._rows:
            header["vocab_rows"] = next(iter(self._rows.values()))
        self._header_json = json.dumps(header, sort_keys=True, separators=(",", ":"))
        self._hash = hashlib.sha256(_FULL_MAGIC + self._header_json.encode())
        elem = torch.empty((), dtype=dtype).element_size()
        st: dict[str, Any] = {"__metadata__": {_FULL_META: self._header_json, _FULL_META_SHA: _PLACEHOLDER}}
        offset = 0
        for (name, _), shape in zip(self._specs, self._file_shapes):
            size = elem * _numel(shape)
            st[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(st, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)
        slot = f'"{_FULL_META_SHA}":"{_PLACEHOLDER}"'.encode()
        if raw.count(slot) != 1:  # pragma: no cover - names are JSON-escaped, so the slot is unique
            raise SyncError("keys", f"{self.final.name}: cannot place the checksum in the header")
        self._sha_at = 8 + raw.index(slot) + len(slot) - len(_PLACEHOLDER) - 1  # before the closing quote
        self._fh: Optional[Any] = None
        try:
            self._fh = open(self.tmp, "w+b")
            self._fh.write(struct.pack("<Q", len(raw)) + raw)
        except OSError as exc:  # e.g. a full disk: the file is lost, the caller's stream goes on
            self._fail(f"writing the header failed ({type(exc).__name__}: {exc})")

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor (as declared; cast to the file's dtype, a vocabulary-parallel one cut to the
        file's rows); records a failure instead of raising."""
        if self.error is not None:
            return
        if self._next >= len(self._specs):
            return self._fail(f"{name}: more tensors than the {len(self._specs)} declared")
        want, shape = self._specs[self._next]
        if name != want or [int(x) for x in tensor.shape] != shape:
            return self._fail(f"got {name} {list(tensor.shape)} where {want} {shape} was declared")
        try:
            if name in self._rows:
                tensor, shape = tensor[: self._rows[name]], self._file_shapes[self._next]
            t = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous()
            self._hash.update(f"|{name}|{t.dtype}|{shape}|".encode())
            if t.numel():
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                self._hash.update(data)
                self._fh.write(data)
        except Exception as exc:  # noqa: BLE001 - a disk error must not interrupt the stream it taps
            return self._fail(f"{name}: {type(exc).__name__}: {exc}")
        self._next += 1

    def finish(self) -> Optional[dict]:
        """Complete the file and move it into place; returns ``{"file", "sha256"}`` for the anchor marker,
        or None (nothing left behind, the reason logged) when any tensor failed or is missing."""
        if self.error is None and self._next != len(self._specs):
            self._fail(f"{len(self._specs) - self._next} declared tensors never came")
        try:
            if self.error is None:
                digest = self._hash.hexdigest()
                self._fh.seek(self._sha_at)
                self._fh.write(digest.encode())
                self._fh.flush()
                os.fsync(self._fh.fileno())
                self._fh.close()
                os.replace(self.tmp, self.final)
                fsync_dir(self.final.parent)
                logger.info("full weights at version %d written to %s", self.version, self.final.name)
                return {"file": self.final.name, "sha256": digest}
        except OSError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self.abort()
        logger.error("%s was not written (%s): an engine that reads the directory cannot reload the weights of "
                     "this refit from it", self.final.name, self.error)
        return None

    def abort(self) -> None:
        """Close and delete the temporary file (idempotent; never raises: a directory that is gone or is no
        longer a directory leaves nothing to delete, another failure is logged)."""
        try:
            if self._fh is not None and not self._fh.closed:
                self._fh.close()
        except OSError as exc:  # a full disk can fail the close's flush too
            logger.warning("closing %s failed (%s: %s)", self.tmp.name, type(exc).__name__, exc)
        try:
            self.tmp.unlink(missing_ok=True)
        except NotADirectoryError:  # the directory was replaced by a file: no temporary file to delete
            pass
        except OSError as exc:
            logger.warning("cannot delete the temporary file %s (%s: %s)", self.tmp, type(exc).__name__, exc)


