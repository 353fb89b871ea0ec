"""The producer's half of a delta directory: claim it, publish deltas, prune and clear the chain.

A delta is written atomically and never overwritten: a temporary file, fsync, a hard link to the final
name (so an existing version is kept; a filesystem without hard links gets an existence check and a
rename), fsync of the directory. Re-publishing identical bytes is a no-op, different bytes for a published
version are refused (``SyncError("exists")``). One producer per directory: :meth:`_DirectoryWriter.claim`
takes an exclusive ``flock`` the kernel releases when the process dies, so a second trainer pointed at the
same directory is refused instead of interleaving its chain with the first one's. Anchor markers and
full-weights files are :class:`~megatron_logra.sync.anchors.AnchorDirectory`'s; the whole protocol is
described in :mod:`megatron_logra.sync.transport`'s docstring.

Imports only torch, safetensors (via the codec) and the standard library.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Optional, Union

from megatron_logra.dirlock import LockUnsupported, lock_directory
from megatron_logra.sync.anchors import AnchorDirectory, newest_epoch
from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.directory_files import (_ANCHOR_RE, _ANCHOR_TMP_RE, _FILE_RE, _FULL_RE, _FULL_TMP_RE,
                                                 _TMP_RE, anchor_filename, delta_filename)
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights import full_filename, fsync_dir

logger = logging.getLogger(__name__)


class _DirectoryWriter(AnchorDirectory):
    """The producer's side of a delta directory: ``claim``, ``clear``, ``publish``, ``prune`` (and, from
    :class:`~megatron_logra.sync.anchors.AnchorDirectory`, ``write_anchor`` and the full-weights writers)."""

    def claim(self) -> None:
        """Producer: take this directory's producer lock (an exclusive, non-blocking ``flock`` on the
        directory, held until this process exits; idempotent within a process). Raises
        ``SyncError("config")`` when another process holds it: two trainers must not write one chain (their
        versions would collide and their anchors and prunes delete each other's files). The kernel drops the
        lock of a process that dies, so a restarted or resumed trainer claims it again. Where the filesystem
        cannot lock a directory, a warning is logged and the call returns. A directory that could not be created
        (a read-only filesystem, no permission) is ``SyncError("config")`` naming it."""
        if self._uncreatable is not None and not self.dir.is_dir():
            raise SyncError("config", self._uncreatable)
        try:
            taken = lock_directory(self.dir)
        except LockUnsupported as exc:
            logger.warning("cannot lock the delta directory %s (%s: %s): a second trainer writing there would not be "
                           "detected", self.dir, type(exc).__name__, exc.strerror or exc)
            return
        except OSError as exc:
            raise SyncError("config", f"cannot open the delta directory {self.dir} to lock it ({type(exc).__name__}: "
                                      f"{exc.strerror or exc})") from None
        if not taken:
            raise SyncError("config", f"another process is already writing deltas into {self.dir} (it holds the "
                                      "directory's producer lock): two trainers must not share a delta "
                                      "directory; give this run its own sync.directory (or train.run_dir), or "
                                      "stop the other run first")

    def clear(self, above_version: Optional[int] = None) -> list[str]:
        """Start a fresh chain (whose first anchor the producer writes next): delete the leftover temporary
        files and every published delta, anchor marker and full-weights file of this transport, or with
        ``above_version`` only those of versions above it (a trainer resuming at that version: the files up
        to it are its own trajectory's, and a consumer behind it can still follow them up to its anchor).
        Nothing else in the directory is touched. Returns the names removed."""
        removed = []
        for entry in sorted(self._entries()):
            if _TMP_RE.match(entry) or _ANCHOR_TMP_RE.match(entry) or _FULL_TMP_RE.match(entry):
                gone = True
            else:
                m = _FILE_RE.match(entry) or _ANCHOR_RE.match(entry) or _FULL_RE.match(entry)
                gone = m is not None and (above_version is None or int(m.group(1)) > above_version)
            if gone:
                (self.dir / entry).unlink(missing_ok=True)
                removed.append(entry)
        return removed

    # ------------------------------------------------------------------ producer
    def publish(self, delta: Union[SketchDelta, bytes]) -> Path:
        """Write one delta atomically; returns its path. Raises ``SyncError("exists")`` if that
        version was already published with different bytes.

        The delta is written naming its ``chain``: the epoch of this directory's newest anchor marker at or below
        its base version (None without one), which a consumer checks against the anchor it follows (a
        :class:`SketchDelta` given gets its ``chain`` and ``checksum`` set). A delta that already names another chain
        is refused (``SyncError("version")``)."""
        if not isinstance(delta, SketchDelta):
            delta = decode(bytes(delta))  # refuse to publish what a consumer would reject
        chain = self._chain_at(delta.base_version)
        if delta.chain is not None and delta.chain != chain:
            raise SyncError("version", f"the delta {delta.base_version}->{delta.new_version} continues the chain of "
                                       f"anchor epoch {delta.chain}, but {self.dir}'s chain at version "
                                       f"{delta.base_version} runs from epoch {chain}")
        delta.chain = chain
        data, version = encode(delta), delta.new_version  # sets delta.checksum
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
        fsync_dir(self.dir)
        logger.info("published %s (%d bytes)", final.name, len(data))
        return final

    def _chain_at(self, version: int) -> Optional[str]:
        """The epoch of the newest anchor at or below ``version``: the one this producer wrote last (it writes one
        at every refit and when its chain starts), else the directory's (None without one, or when its markers
        cannot be read: the delta then names no chain, and consumers check versions only)."""
        if self._written is not None and self._written[0] <= version:
            return self._written[1]
        try:
            return newest_epoch(self.anchors(since=version), version)
        except SyncError:
            return None

    def prune(self, below_version: int) -> list[int]:
        """Delete published deltas with ``new_version < below_version``, and the anchor markers (with their
        full-weights files) no consumer that can still extend the chain (at version ``>= below_version - 1``)
        needs: those older than the newest anchor at or below ``below_version - 1``. A consumer further behind
        then meets a ``gap`` naming the full weights to reload. Returns the delta versions removed."""
        removed = [v for v in self.versions() if v < below_version]
        for v in removed:
            (self.dir / delta_filename(v)).unlink(missing_ok=True)
        anchored = sorted(int(m.group(1)) for m in map(_ANCHOR_RE.match, self._entries()) if m)
        keep_from = max((a for a in anchored if a <= below_version - 1), default=None)
        for a in anchored:
            if keep_from is not None and a < keep_from:
                (self.dir / anchor_filename(a)).unlink(missing_ok=True)
        for v in self.full_files():  # with its anchor
            if keep_from is not None and v < keep_from:
                (self.dir / full_filename(v)).unlink(missing_ok=True)
        return removed
