"""Transports for encoded sketch deltas.

* :class:`InProcessTransport`: encode (optional) and hand the delta straight to an engine
  object with ``apply_sketch_delta`` (the embedded CPU engine, tests).
* :class:`DirectoryTransport`: files on a shared disk. The producer writes
  ``delta_{new_version:08d}.safetensors`` atomically (temporary file, fsync, hard link to the
  final name so an existing version is never overwritten, fsync of the directory); a consumer
  polls for the deltas after its current version and applies them in order, reading and
  applying one file at a time. Re-publishing identical bytes is a no-op, different bytes for a
  published version are refused; a missing link in the chain raises ``SyncError("gap")``, a
  file forking from it ``SyncError("version")``.

  Version numbers alone do not name a trajectory: a trainer that resumes from an earlier
  checkpoint starts a new chain at a version a consumer may already have passed, and a
  trainer's full refit (anchor, re-anchor, drift repair) changes its weights without a delta.
  So the producer also writes an **anchor marker** ``anchor_{version:08d}.json`` (atomically;
  JSON: ``version``, a fresh random ``epoch`` id, and the trainer's ``fingerprint`` of its full
  weights at that version in HF names and the engine's dtype, or null; optionally ``full``, the
  refit's full-weights file, below) at every full refit and when its chain starts
  (:class:`~megatron_logra.rl.policy_sync.PolicySync` does both: its chain starts with a refit). A
  consumer applies a delta only after it has *verified* the newest anchor at or below its
  version: an anchor at exactly its version is verified by comparing the engine's
  ``fingerprint()`` (when it has one; rows sampled with the weight version as salt on both sides,
  :mod:`megatron_logra.sync.fingerprint`) with the marker's, or by :meth:`DirectoryTransport.
  accept_anchor` after the engine reloaded those full weights; a consumer past an anchor it
  has not verified (its weights may come from another trajectory) is refused with
  ``SyncError("anchor")`` naming the full weights to reload.

  **Full weights.** With a refit's anchor the producer also writes the refit's full weights,
  ``full_{version:08d}.safetensors`` (:meth:`DirectoryTransport.full_writer`; the file format is
  :mod:`megatron_logra.sync.full_weights`), and the marker's optional ``full`` entry names it
  with its sha256; writing a marker deletes every other full-weights file, so only the newest
  anchor's is kept (and :meth:`~DirectoryTransport.prune` drops it with its anchor). Trainer ranks
  whose chains hold the same weights may share one file: a marker's ``full`` then names a sibling
  directory's file, ``../<directory>/full_{version:08d}.safetensors`` (``sync.full_weights``).
  :meth:`DirectoryTransport.load_full` checks the file's shapes against the engine before the
  first tensor is copied (an engine with padding rows takes the vocabulary as its first rows).
  A consumer that is refused (an unverified anchor, or a ``gap`` because the deltas it needs were pruned or removed by a trainer
  restart) calls :meth:`DirectoryTransport.load_full`: it verifies the checksum, streams the
  tensors into the engine's ``update_weights_full``, accepts the anchor, and the engine follows
  the chain from there. A consumer remembers the anchors it verified for its lifetime (the
  :class:`DirectoryTransport` object), so a restarted consumer verifies again (by fingerprint at
  an anchor's version, else by reloading); the producer's own transport object counts the
  anchors it writes for its own, freshly refit engine as verified, so the in-process use
  (publish, then the same process's engine consumes) never refuses. A directory without anchor
  markers gets the version-chain checks only. :meth:`DirectoryTransport.consume` checks the anchor at the
  engine's version on every call, also when no new delta is there, so a consumer learns of a trainer that
  resumed from an earlier checkpoint (and now writes another trajectory) as soon as its anchor is written.

  **One producer per directory.** A trainer calls :meth:`DirectoryTransport.claim` before it writes: an
  exclusive ``flock`` on the directory, held while the process lives (the kernel releases it when it dies,
  so a restarted trainer takes it again), so a second trainer pointed at the same directory is refused with
  ``SyncError("config")`` instead of interleaving its chain with the first one's. Where the filesystem
  does not support the lock (some network filesystems) a warning is logged and nothing is checked.

  **A consumer loop.** Point the transport at the directory of the rank the engine serves
  (``<sync.directory>/rank<N>/``) and call :meth:`DirectoryTransport.follow` repeatedly: it consumes,
  and on ``SyncError`` of kind ``anchor`` or ``gap`` reloads the newest anchor's full weights
  (:meth:`DirectoryTransport.load_full`; the engine must accept a reload at an earlier version, as
  :class:`~megatron_logra.sync.engine.ModuleEngine` and the embedded engine do) once per anchor. Any ``SyncError`` it raises left
  the engine unchanged: log it and retry later (a directory that is missing, e.g. while a trainer with
  ``train.overwrite=true`` recreates its run directory, is ``unreadable``; a consumer whose reload cannot
  reach the deltas left waits for the trainer's next refit).

Imports only torch, safetensors (via the codec) and the standard library.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Iterator, Optional, Union

from megatron_logra.dirlock import LockUnsupported, lock_directory
from megatron_logra.sync.anchors import (_ANCHOR_RE, _ANCHOR_TMP_RE, _FILE_RE, _FULL_RE, _FULL_TMP_RE, _TMP_RE,
                                         AnchorDirectory, anchor_filename, delta_filename)
from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.engine import DeltaConsumer
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights import FullWeightsWriter, full_filename, fsync_dir

logger = logging.getLogger(__name__)

__all__ = ["InProcessTransport", "DirectoryTransport", "FullWeightsWriter", "delta_filename", "anchor_filename",
           "full_filename"]


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


class DirectoryTransport(AnchorDirectory):
    """Deltas and anchor markers as files in ``directory`` (producer: ``claim``, ``publish``, ``write_anchor``;
    consumer: ``poll`` / ``consume`` / ``follow``, ``accept_anchor``). See the module docstring for the anchors;
    the markers and full-weights files are :class:`~megatron_logra.sync.anchors.AnchorDirectory`'s."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        super().__init__(directory)
        self._reloaded: Optional[str] = None  # epoch of the anchor follow() last reloaded

    def claim(self) -> None:
        """Producer: take this directory's producer lock (an exclusive, non-blocking ``flock`` on the
        directory, held until this process exits; idempotent within a process). Raises
        ``SyncError("config")`` when another process holds it: two trainers must not write one chain (their
        versions would collide and their anchors and prunes delete each other's files). The kernel drops the
        lock of a process that dies, so a restarted or resumed trainer claims it again. Where the filesystem
        cannot lock a directory, a warning is logged and the call returns."""
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
        fsync_dir(self.dir)
        logger.info("published %s (%d bytes)", final.name, len(data))
        return final

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

    # ------------------------------------------------------------------ consumer
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

    def _chain(self, current_version: int, engine: Optional[DeltaConsumer] = None) -> Iterator[SketchDelta]:
        """Yield the deltas after ``current_version`` in order, reading each file only when the
        previous one has been taken (one decoded delta in memory at a time).

        Raises at the first file that cannot extend the chain: unreadable or corrupt (the
        decode's kind, naming the file), holding another version (``version``), or starting
        below the chain (``version``: it forks from or overlaps the chain). At a missing
        version (a file starting above the chain) it stops after a non-empty prefix (the
        missing delta may still be published) and raises ``SyncError("gap")`` otherwise.

        Before each delta the anchors are checked at its base version (:meth:`_check_anchor`):
        ``engine`` is the consumer that applied every delta yielded so far (:meth:`consume`), so
        it is fingerprinted at that version; without one (:meth:`poll`) an unverified anchor
        raises at ``current_version`` and ends a non-empty prefix further on. With an ``engine`` and
        no delta after ``current_version`` the anchor is checked at ``current_version`` all the same.

        A directory holding ``rank<N>/`` chain directories and no chain is refused
        (``SyncError("config")``: ``sync.directory`` itself, not a rank's directory). A listed delta
        that is gone when it is read (pruned or cleared by the producer meanwhile) is a ``gap``.
        """
        expected = current_version
        yielded = 0
        entries = self._entries()
        self._not_a_root(entries)
        versions = sorted(int(m.group(1)) for m in map(_FILE_RE.match, entries) if m)
        anchors = self.anchors()  # after the listing: an anchor written before a listed delta is seen
        for v in versions:
            if v <= current_version:
                continue
            try:
                delta = self.read(v)
            except SyncError:
                if os.path.lexists(self.dir / delta_filename(v)):
                    raise
                msg = (f"{delta_filename(v)} was removed from {self.dir} while this consumer (at version {expected}) "
                       f"read the chain (pruned, sync.keep_deltas, or cleared by a trainer restart)")
                if yielded:
                    logger.warning("%s; stopping after the %d deltas before it", msg, yielded)
                    return
                raise SyncError("gap", f"{msg}; this engine cannot catch up through deltas: "
                                       f"{self._reload_advice(self.anchors())}") from None
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
                if v == versions[0]:  # nothing older is left: the producer deleted them, they will not come
                    msg = (f"{delta_filename(v)} starts at version {delta.base_version} but the engine is at "
                           f"{expected}: the delta(s) for versions ({expected}, {delta.base_version}] are no longer in {self.dir} "
                           f"(pruned, sync.keep_deltas, or removed by a trainer restart); this engine cannot catch "
                           f"up through deltas: {self._reload_advice(anchors, versions)}")
                raise SyncError("gap", msg)
            try:
                self._check_anchor(expected, engine, anchors)
            except SyncError as exc:
                if yielded and engine is None:  # poll: the caller verifies the anchor at `expected` first
                    logger.warning("%s; stopping after the %d deltas before it", exc, yielded)
                    return
                raise
            yield delta
            del delta  # not held while the next file is read
            yielded += 1
            expected = v
        if not yielded and engine is not None:  # nothing new: is the engine still on the trainer's chain?
            self._check_anchor(current_version, engine, anchors)

    def poll(self, current_version: int) -> list[SketchDelta]:
        """The chain of deltas after ``current_version``, in order (all decoded; :meth:`consume`
        applies them one file at a time instead).

        Each delta's ``base_version`` must be the previous one's ``new_version`` (the first:
        ``current_version``). At a missing version the contiguous prefix is returned; with no
        prefix, ``SyncError("gap")`` names the missing versions. A corrupt or unreadable file,
        or one starting below the chain (``SyncError("version")``: it forks from or overlaps
        it), raises. Deltas at or below ``current_version`` are skipped (already applied). An
        anchor not yet verified at or below ``current_version`` raises ``SyncError("anchor")``
        (verify it with :meth:`verify_anchor` or :meth:`accept_anchor`); one further along ends
        the returned prefix at its version.
        """
        return list(self._chain(current_version))

    def follow(self, engine: DeltaConsumer) -> list[int]:
        """Consumer: one step of a consumer loop; returns the versions applied. :meth:`consume`, and when it is
        refused with ``SyncError`` of kind ``anchor`` or ``gap``, :meth:`load_full` of the newest anchor and
        :meth:`consume` again. The newest anchor is reloaded at most once by this object: when that did not get
        the engine back on the chain (its deltas were pruned past it, or it has no full-weights file) the
        refusal is raised as it is, until the trainer writes a newer anchor, so a loop does not re-read a
        model-sized file at every poll. Every ``SyncError`` raised leaves the engine as the last successful
        apply or reload left it; call again later."""
        try:
            return self.consume(engine)
        except SyncError as exc:
            if exc.kind not in ("anchor", "gap"):
                raise
            newest = self.anchors()
            if not newest or newest[-1].get("full") is None or newest[-1]["epoch"] == self._reloaded:
                raise
        self._reloaded = self.load_full(engine)["epoch"]
        return self.consume(engine)

    def consume(self, engine: DeltaConsumer) -> list[int]:
        """Apply the new deltas to ``engine`` in order, one file at a time (read, check its link
        to the chain, apply, next); returns the versions applied.

        Raises at the first file that cannot be applied (corrupt, unreadable, forking from the
        chain, rejected by the engine; a missing version when nothing before it was applied; an
        anchor the engine cannot verify, ``SyncError("anchor")``, see the module docstring):
        deltas applied before it stay applied and the engine's ``weight_version`` says where to
        resume. A missing version after applied deltas ends the call (see :meth:`poll`). With no new
        delta the anchor at the engine's version is still checked, so an engine left on a trajectory the
        trainer abandoned (it resumed from an earlier checkpoint, or refit) is refused at once rather than
        when the trainer's chain passes its version. A missing directory is ``SyncError("unreadable")``.
        """
        applied = []
        for delta in self._chain(engine.weight_version, engine):
            applied.append(engine.apply_sketch_delta(delta))
            del delta  # not held while the next file is read
        return applied
