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
  ``SyncError("anchor")`` naming the full weights to reload. Each delta names the chain it continues (its
  header's ``chain``: the epoch of the producer's newest anchor at or below its base version, set by
  ``publish``), and a delta naming another chain than the consumer's anchor is refused (``SyncError("version")``):
  a delta of another run copied into the directory fits the version chain, but not this one.

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
  and on ``SyncError`` of kind ``anchor``, on a ``gap``, or at a delta file that cannot extend the chain
  (corrupt, unreadable, another version: it stays refused, naming its path, since a published delta is
  never rewritten) reloads the newest anchor's full weights where the chain can be followed from them
  (:meth:`DirectoryTransport.load_full`; the engine must accept a reload at an earlier version, as
  :class:`~megatron_logra.sync.engine.ModuleEngine` and the embedded engine do) once per anchor. Any ``SyncError`` it raises left
  the engine unchanged: log it and retry later (a directory that is missing, e.g. while a trainer with
  ``train.overwrite=true`` recreates its run directory, is ``unreadable``; a consumer whose reload cannot
  reach the deltas left, or stopped at a bad file, waits for the trainer's next refit). A consumer pointed at a directory that is not a
  delta directory -- one holding none of a chain's files but other entries, such as the run directory itself
  (``RUN_DIR`` instead of ``RUN_DIR/deltas/rank0``) -- is refused with ``SyncError("config")`` naming the
  directory to use, instead of waiting forever; one whose directory did not exist (this object created it
  empty) logs a warning once, so a mistyped path does not wait in silence.

The directory transport is assembled from its producer's half (:mod:`~megatron_logra.sync.directory_writer`:
claim, publish, prune, clear), its consumer's half (:mod:`~megatron_logra.sync.directory_reader`: read,
poll, consume, follow), the anchor markers and full-weights files (:mod:`~megatron_logra.sync.anchors`,
:mod:`~megatron_logra.sync.anchor_markers`, :mod:`~megatron_logra.sync.anchor_full`) and the directory's file
names (:mod:`~megatron_logra.sync.directory_files`).

Imports only torch, safetensors (via the codec) and the standard library.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, Union

from megatron_logra.sync.codec import SketchDelta, encode
from megatron_logra.sync.directory_files import (_ANCHOR_RE, _ANCHOR_TMP_RE, _FILE_RE, _FULL_RE, _FULL_TMP_RE,
                                                  _TMP_RE, anchor_filename, delta_filename)
from megatron_logra.sync.directory_reader import _DirectoryReader
from megatron_logra.sync.directory_writer import _DirectoryWriter
from megatron_logra.sync.engine import DeltaConsumer
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights import FullWeightsWriter, full_filename

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


class DirectoryTransport(_DirectoryWriter, _DirectoryReader):
    """Deltas and anchor markers as files in ``directory`` (producer: ``claim``, ``publish``, ``write_anchor``;
    consumer: ``poll`` / ``consume`` / ``follow``, ``accept_anchor``). See the module docstring for the anchors;
    the markers and full-weights files are :class:`~megatron_logra.sync.anchors.AnchorDirectory`'s."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        existed = os.path.lexists(directory)
        super().__init__(directory)
        self._created_empty = not existed  # this object made the directory (a producer's first run, or a typo)
        self._claimed = False

    def claim(self) -> None:
        super().claim()
        self._claimed = True

    def _not_a_root(self, entries: Iterable[str]) -> None:
        """Consumer: besides ``sync.directory`` itself (the base class), refuse a directory that holds none of
        a chain's files but other entries (a run directory, a checkpoint, anything else), where polling would
        wait forever; warn once when this consumer created the directory it waits in."""
        entries = list(entries)
        super()._not_a_root(entries)
        chain_res = (_FILE_RE, _ANCHOR_RE, _FULL_RE, _TMP_RE, _ANCHOR_TMP_RE, _FULL_TMP_RE)
        if any(r.match(e) for e in entries for r in chain_res):
            return
        entries = [e for e in entries if not e.startswith(".")]  # NFS's .nfsXXXX of a pruned file still open, ...
        if not entries:
            if self._created_empty and not self._claimed:
                self._created_empty = False  # warn once
                logger.warning("delta directory %s did not exist and was created empty: this consumer waits for "
                               "a trainer to write there; if the trainer is running, check the path (a rank's "
                               "directory, <sync.directory>/rank<N>, default RUN_DIR/deltas/rank0)", self.dir)
            return
        others = sorted(entries)
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        if (self.dir / "deltas").is_dir():
            fix = (f"this looks like a run directory: its deltas are in {self.dir / 'deltas'}/rank<N>, "
                   f"e.g. {self.dir / 'deltas' / 'rank0'}")
        else:
            fix = "point the consumer at the directory of the rank it serves, <sync.directory>/rank<N> " \
                  "(default RUN_DIR/deltas/rank0)"
        raise SyncError("config", f"{self.dir} is not a delta directory: it holds no delta_*.safetensors, "
                                  f"anchor_*.json or full_*.safetensors but other entries ({shown}); {fix}")
