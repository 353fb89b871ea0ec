"""Transports for encoded sketch deltas.

* :class:`InProcessTransport`: encode (optional) and hand the delta straight to an engine
  object with ``apply_sketch_delta`` (the embedded CPU engine, tests).
* :class:`DirectoryTransport`: files on a shared disk. The producer writes
  ``delta_{new_version:08d}.safetensors`` atomically (temporary file, fsync, hard link to the
  final name so an existing version is never overwritten, fsync of the directory); a consumer
  polls for the deltas after its current version and applies them in order. The only
  consumer state is the engine's ``weight_version``, so both sides survive restarts;
  re-publishing identical bytes is a no-op, different bytes for a published version are
  refused. The consumer reads and applies one file at a time; a missing link in the chain
  raises ``SyncError("gap")``, a file forking from it ``SyncError("version")``.

Imports only torch, safetensors (via the codec) and the standard library.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path
from typing import Iterator, Union

from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.engine import DeltaConsumer
from megatron_logra.sync.errors import SyncError

logger = logging.getLogger(__name__)

__all__ = ["InProcessTransport", "DirectoryTransport", "delta_filename"]

_FILE_RE = re.compile(r"^delta_(\d{8,})\.safetensors$")
_TMP_RE = re.compile(r"^\.delta_\d{8,}\.safetensors\..+\.tmp$")


def delta_filename(new_version: int) -> str:
    return f"delta_{new_version:08d}.safetensors"


class InProcessTransport:
    """Send deltas to ``engine`` in the same process; ``encode=True`` sends the wire bytes (and counts them)."""

    def __init__(self, engine: DeltaConsumer, *, encode: bool = True) -> None:
        self.engine = engine
        self.encode = encode
        self.bytes_sent = 0
        self.num_sent = 0

    def send(self, delta: Union[SketchDelta, bytes]) -> int:
        """Deliver one delta; returns the engine's new version (raises ``SyncError`` on rejection)."""
        payload: Union[SketchDelta, bytes] = delta
        if self.encode and isinstance(delta, SketchDelta):
            payload = encode(delta)
        if isinstance(payload, (bytes, bytearray)):
            self.bytes_sent += len(payload)
        version = self.engine.apply_sketch_delta(payload)
        self.num_sent += 1
        return version


def _fsync_dir(path: Path) -> None:
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


class DirectoryTransport:
    """Deltas as files in ``directory`` (producer: ``publish``; consumer: ``poll`` / ``consume``)."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise SyncError("config", f"delta directory {self.dir} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)

    def clear(self) -> list[str]:
        """Delete every published delta and leftover temporary file of this transport (a fresh chain);
        nothing else in the directory is touched. Returns the names removed."""
        removed = []
        for entry in sorted(os.listdir(self.dir)):
            if _FILE_RE.match(entry) or _TMP_RE.match(entry):
                (self.dir / entry).unlink(missing_ok=True)
                removed.append(entry)
        return removed

    # ------------------------------------------------------------------ producer
    def publish(self, delta: Union[SketchDelta, bytes]) -> Path:
        """Write one delta atomically; returns its path. Raises ``SyncError("exists")`` if that
        version was already published with different bytes."""
        if isinstance(delta, SketchDelta):
            data, version = encode(delta), delta.new_version
        else:
            data = bytes(delta)
            version = decode(data).new_version  # refuse to publish what a consumer would reject
        final = self.dir / delta_filename(version)
        tmp = self.dir / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as fh:  # a failed write (e.g. a full disk) leaves no partial file behind
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, final)  # atomic and never clobbers
            except FileExistsError:
                if final.read_bytes() != data:
                    raise SyncError("exists", f"{final.name} already holds a different delta for version {version}") from None
                logger.info("%s already published (identical bytes)", final.name)
            except OSError:  # filesystems without hard links
                if final.exists():
                    if final.read_bytes() != data:
                        raise SyncError("exists", f"{final.name} already holds a different delta for version {version}") from None
                else:
                    os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(self.dir)
        logger.info("published %s (%d bytes)", final.name, len(data))
        return final

    def prune(self, below_version: int) -> list[int]:
        """Delete published deltas with ``new_version < below_version``; returns the versions removed."""
        removed = [v for v in self.versions() if v < below_version]
        for v in removed:
            (self.dir / delta_filename(v)).unlink(missing_ok=True)
        return removed

    # ------------------------------------------------------------------ consumer
    def versions(self) -> list[int]:
        """Published ``new_version`` numbers, ascending (temporary files ignored)."""
        out = []
        for entry in os.listdir(self.dir):
            m = _FILE_RE.match(entry)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def read(self, version: int) -> SketchDelta:
        """Decode the delta published as ``version`` (``SyncError`` names the file on corruption)."""
        path = self.dir / delta_filename(version)
        try:
            data = path.read_bytes()
        except OSError as exc:  # a folder or a dangling link in its place, permissions: unreadable, not a crash
            raise SyncError("unreadable", f"{path.name}: cannot be read ({type(exc).__name__}: {exc.strerror})") from None
        try:
            return decode(data)
        except SyncError as exc:
            raise SyncError(exc.kind, f"{path.name}: {str(exc).removeprefix(f'[{exc.kind}] ')}") from None

    def _chain(self, current_version: int) -> Iterator[SketchDelta]:
        """Yield the deltas after ``current_version`` in order, reading each file only when the
        previous one has been taken (one decoded delta in memory at a time).

        Raises at the first file that cannot extend the chain: unreadable or corrupt (the
        decode's kind, naming the file), holding another version (``version``), or starting
        below the chain (``version``: it forks from or overlaps the chain). At a missing
        version (a file starting above the chain) it stops after a non-empty prefix (the
        missing delta may still be published) and raises ``SyncError("gap")`` otherwise.
        """
        expected = current_version
        yielded = 0
        for v in self.versions():
            if v <= current_version:
                continue
            delta = self.read(v)
            if delta.new_version != v:
                raise SyncError("version", f"{delta_filename(v)} holds version {delta.new_version}")
            if delta.base_version < expected:
                raise SyncError("version", f"{delta_filename(v)} is the delta {delta.base_version}->{v} but the chain is "
                                           f"already at {expected}: it forks from or overlaps the chain")
            if delta.base_version > expected:
                msg = (f"{delta_filename(v)} starts at version {delta.base_version} but the chain is at {expected}: "
                       f"the delta(s) for versions ({expected}, {delta.base_version}] are missing")
                if yielded:  # the contiguous prefix was handed out; the next call raises
                    logger.warning("%s; stopping after the %d deltas before the gap", msg, yielded)
                    return
                raise SyncError("gap", msg)
            yield delta
            del delta  # not held while the next file is read
            yielded += 1
            expected = v

    def poll(self, current_version: int) -> list[SketchDelta]:
        """The chain of deltas after ``current_version``, in order (all decoded; :meth:`consume`
        applies them one file at a time instead).

        Each delta's ``base_version`` must be the previous one's ``new_version`` (the first:
        ``current_version``). At a missing version the contiguous prefix is returned; with no
        prefix, ``SyncError("gap")`` names the missing versions. A corrupt or unreadable file,
        or one starting below the chain (``SyncError("version")``: it forks from or overlaps
        it), raises. Deltas at or below ``current_version`` are skipped (already applied).
        """
        return list(self._chain(current_version))

    def consume(self, engine: DeltaConsumer) -> list[int]:
        """Apply the new deltas to ``engine`` in order, one file at a time (read, check its link
        to the chain, apply, next); returns the versions applied.

        Raises at the first file that cannot be applied (corrupt, unreadable, forking from the
        chain, rejected by the engine; a missing version when nothing before it was applied):
        deltas applied before it stay applied and the engine's ``weight_version`` says where to
        resume. A missing version after applied deltas ends the call (see :meth:`poll`).
        """
        applied = []
        for delta in self._chain(engine.weight_version):
            applied.append(engine.apply_sketch_delta(delta))
            del delta  # not held while the next file is read
        return applied
