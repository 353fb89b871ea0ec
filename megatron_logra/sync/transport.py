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
  :class:`~megatron_logra.sync.engine.ModuleEngine` does) once per anchor. Any ``SyncError`` it raises left
  the engine unchanged: log it and retry later (a directory that is missing, e.g. while a trainer with
  ``train.overwrite=true`` recreates its run directory, is ``unreadable``; a consumer whose reload cannot
  reach the deltas left waits for the trainer's next refit).

Imports only torch, safetensors (via the codec) and the standard library.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.engine import DeltaConsumer, full_shape_problems
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.fingerprint import drift, fingerprint_salt
from megatron_logra.sync.full_weights import FullWeightsReader, FullWeightsWriter, full_filename, fsync_dir

logger = logging.getLogger(__name__)

__all__ = ["InProcessTransport", "DirectoryTransport", "FullWeightsWriter", "delta_filename", "anchor_filename",
           "full_filename"]

_FILE_RE = re.compile(r"^delta_(\d{8,})\.safetensors$")
_TMP_RE = re.compile(r"^\.delta_\d{8,}\.safetensors\..+\.tmp$")
_ANCHOR_RE = re.compile(r"^anchor_(\d{8,})\.json$")
_ANCHOR_TMP_RE = re.compile(r"^\.anchor_\d{8,}\.json\..+\.tmp$")
_FULL_RE = re.compile(r"^full_(\d{8,})\.safetensors$")
_FULL_TMP_RE = re.compile(r"^\.full_\d{8,}\.safetensors\..+\.tmp$")
_ANCHOR_KEYS = {"version", "epoch", "fingerprint"}
_ANCHOR_OPTIONAL = {"full"}
_FULL_KEYS = {"file", "sha256"}
_SIBLING_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_RANK_DIR_RE = re.compile(r"^rank\d+$")
_PRODUCER_LOCKS: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a directory -> this process's locked fd


def delta_filename(new_version: int) -> str:
    return f"delta_{new_version:08d}.safetensors"


def anchor_filename(version: int) -> str:
    return f"anchor_{version:08d}.json"


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


def _valid_marker(marker: Any) -> bool:
    if not isinstance(marker, dict) or not _ANCHOR_KEYS <= set(marker) <= _ANCHOR_KEYS | _ANCHOR_OPTIONAL:
        return False
    version, epoch, fp = marker["version"], marker["epoch"], marker["fingerprint"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return False
    if not isinstance(epoch, str) or not epoch:
        return False
    full = marker.get("full")
    if full is not None and not (isinstance(full, dict) and set(full) == _FULL_KEYS
                                 and _full_file_ok(full["file"], version) and _is_sha256(full["sha256"])):
        return False
    return fp is None or (isinstance(fp, dict)
                          and all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()))


def _full_file_ok(file: Any, version: int) -> bool:
    """A marker's ``full`` file: ``full_<version>.safetensors`` in its own directory, or in a sibling directory
    (``../<name>/full_<version>.safetensors``: another trainer rank's chain that wrote the file for all)."""
    if not isinstance(file, str):
        return False
    if file == full_filename(version):
        return True
    parts = file.split("/")
    return (len(parts) == 3 and parts[0] == ".." and _SIBLING_RE.match(parts[1]) is not None
            and parts[1] not in (".", "..") and parts[2] == full_filename(version))


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _write_atomically(final: Path, data: bytes) -> None:
    tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


class DirectoryTransport:
    """Deltas and anchor markers as files in ``directory`` (producer: ``publish``, ``write_anchor``;
    consumer: ``poll`` / ``consume``, ``accept_anchor``). See the module docstring for the anchors."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise SyncError("config", f"delta directory {self.dir} exists and is not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only or full filesystem, no permission
            raise SyncError("config", f"cannot create the delta directory {self.dir} ({type(exc).__name__}: "
                                      f"{exc.strerror or exc}): create it, or choose a writable sync.directory") from None
        self._verified: set[str] = set()  # epochs of the anchors this object's consumer verified (or wrote)
        self._reloaded: Optional[str] = None  # epoch of the anchor follow() last reloaded

    def _entries(self) -> list[str]:
        """The names in the directory; a missing or unlistable directory is ``SyncError("unreadable")``."""
        try:
            return os.listdir(self.dir)
        except FileNotFoundError:
            raise SyncError("unreadable", f"the delta directory {self.dir} does not exist (any more): the trainer's "
                                          "run directory was deleted or is being recreated (train.overwrite=true), "
                                          "or the path is wrong; retry: once a trainer writes there again its first "
                                          "anchor tells this consumer to reload") from None
        except OSError as exc:
            raise SyncError("unreadable", f"the delta directory {self.dir} cannot be listed ({type(exc).__name__}: "
                                          f"{exc.strerror or exc})") from None

    def _not_a_root(self, entries: Iterable[str]) -> None:
        """Consumer: refuse a directory that holds the trainer ranks' chain directories (``rank<N>/``) and no
        chain of its own -- ``sync.directory`` itself, where polling would wait forever."""
        entries = list(entries)
        if any(_FILE_RE.match(e) or _ANCHOR_RE.match(e) or _FULL_RE.match(e) for e in entries):
            return
        ranks = sorted((e for e in entries if _RANK_DIR_RE.match(e) and (self.dir / e).is_dir()),
                       key=lambda e: int(e[4:]))
        if ranks:
            raise SyncError("config", f"{self.dir} holds the trainer ranks' delta directories ({', '.join(ranks[:4])}"
                                      f"{', ...' if len(ranks) > 4 else ''}), not a chain: point the consumer at the "
                                      f"directory of the rank it serves, e.g. {self.dir / ranks[0]} (sync.directory "
                                      "is their root)")

    def claim(self) -> None:
        """Producer: take this directory's producer lock (an exclusive, non-blocking ``flock`` on the
        directory, held until this process exits; idempotent within a process). Raises
        ``SyncError("config")`` when another process holds it: two trainers must not write one chain (their
        versions would collide and their anchors and prunes delete each other's files). The kernel drops the
        lock of a process that dies, so a restarted or resumed trainer claims it again. Where the filesystem
        cannot lock a directory, a warning is logged and the call returns."""
        try:
            st = os.stat(self.dir)
            key = (st.st_dev, st.st_ino)
            if key in _PRODUCER_LOCKS:
                return
            fd = os.open(self.dir, os.O_RDONLY)
        except OSError as exc:
            raise SyncError("config", f"cannot open the delta directory {self.dir} to lock it ({type(exc).__name__}: "
                                      f"{exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SyncError("config", f"another process is already writing deltas into {self.dir} (it holds the "
                                          "directory's producer lock): two trainers must not share a delta "
                                          "directory; give this run its own sync.directory (or train.run_dir), or "
                                          "stop the other run first") from None
            logger.warning("cannot lock the delta directory %s (%s: %s): a second trainer writing there would not be "
                           "detected", self.dir, type(exc).__name__, exc.strerror or exc)
            return
        _PRODUCER_LOCKS[key] = fd  # held for the process's lifetime (closing any copy would release it)

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

    # ------------------------------------------------------------------ full weights
    def full_writer(self, version: int, specs: Sequence[tuple[str, Sequence[int]]],
                    dtype: torch.dtype, vocab_rows: Optional[int] = None) -> FullWeightsWriter:
        """Producer: a writer of ``full_<version>.safetensors``, the trainer's full weights at ``version`` in
        HF names and the engine's ``dtype``; ``specs`` lists every ``(name, shape)`` in the order
        :meth:`FullWeightsWriter.add` will receive them; ``vocab_rows``: the model's vocabulary, to which the
        vocabulary-parallel tensors are cut (:class:`FullWeightsWriter`). Pass what
        :meth:`FullWeightsWriter.finish` returns to :meth:`write_anchor` (``full=``): the marker then names the
        file and its checksum."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SyncError("config", f"full-weights version must be an int >= 0, got {version!r}")
        return FullWeightsWriter(self.dir, version, specs, dtype, vocab_rows)

    def write_full(self, version: int, tensors: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                   dtype: Optional[torch.dtype] = None, vocab_rows: Optional[int] = None) -> Optional[dict]:
        """Producer: write ``tensors`` (a mapping; or ``(name, tensor)`` pairs, then held in memory to list
        them first) as the full weights at ``version`` in ``dtype`` (None: the first tensor's; ``vocab_rows``:
        see :meth:`full_writer`); returns what :meth:`FullWeightsWriter.finish` does. A trainer streaming its
        weights uses :meth:`full_writer`."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        if dtype is None:
            dtype = items[0][1].dtype if items else torch.float32
        writer = self.full_writer(version, [(n, list(t.shape)) for n, t in items], dtype, vocab_rows)
        for name, t in items:
            writer.add(name, t)
        return writer.finish()

    def full_files(self) -> list[int]:
        """Versions of the full-weights files in the directory, ascending."""
        return sorted(int(m.group(1)) for m in map(_FULL_RE.match, self._entries()) if m)

    def open_full(self, version: Optional[int] = None) -> "FullWeightsReader":
        """Consumer: open and verify (sha256, and that it is the file the anchor marker names) the full-weights
        file of the anchor at ``version`` (None: the newest anchor). Returns a context manager whose
        ``tensors()`` yields ``(HF name, tensor)`` one at a time and ``shapes()`` lists them, for engines that
        load weights themselves (:meth:`load_full` does it for engines with ``update_weights_full``); its
        ``anchor`` is the marker the file was opened for (what to verify once the tensors are loaded: a
        marker written at the same version meanwhile belongs to other weights). Raises ``SyncError``
        (``anchor`` when that anchor has no full-weights file)."""
        anchor = self._anchor_for(version)
        full = anchor.get("full")
        if full is None:
            raise SyncError("anchor", f"the anchor at version {anchor['version']} has no full-weights file in "
                                      f"{self.dir} (the producer wrote none, e.g. a chain start before its first "
                                      "refit or a failed write): reload the trainer's weights at that version by other "
                                      f"means and call accept_anchor({anchor['version']})")
        reader = FullWeightsReader(self._full_path(full), anchor["version"], full["sha256"])
        reader.anchor = anchor
        return reader

    def load_full(self, engine: Any, version: Optional[int] = None) -> dict:
        """Consumer: load the full weights of the anchor at ``version`` (None: the newest) into ``engine`` with
        its ``update_weights_full(stream, version)`` (one tensor at a time), which sets its ``weight_version``,
        then count the anchor whose file was read as verified and return its marker. The remedy the
        ``anchor`` and ``gap`` errors of :meth:`consume` name. The file's sha256 is verified before the first
        tensor reaches the engine; an engine's refusal is raised as ``SyncError("apply")``.

        The file's names and shapes are checked against the engine before the first tensor is copied, so a file
        the engine cannot hold leaves its weights and version untouched (``SyncError("shape")``): by the
        engine's ``check_full_shapes(shapes)`` when it has one (:class:`~megatron_logra.sync.engine.
        ModuleEngine`: an engine holding more vocabulary rows than the file, e.g. padded ones, takes the file's
        rows as its first rows), else against its ``expected_shapes()`` exactly, when it lists them. The file
        holds the model's vocabulary (``model.vocab_size`` rows of ``embed_tokens``/``lm_head``, the header's
        ``vocab_rows``), as the model's HF checkpoint does.

        The anchor verified is the marker the file was opened for, never one found at that version after the
        load: a producer that restarts and refits at the same version while the file is streamed writes a new
        marker (another epoch, other weights), which stays unverified, so the next :meth:`consume` refuses at
        it and the consumer reloads."""
        load = getattr(engine, "update_weights_full", None)
        if not callable(load):
            raise SyncError("config", f"{type(engine).__name__} has no update_weights_full(stream, version): load "
                                      "the tensors of open_full() yourself, then call accept_anchor")
        with self.open_full(version) as reader:
            check, expected = getattr(engine, "check_full_shapes", None), getattr(engine, "expected_shapes", None)
            if callable(check):
                check(reader.shapes())
            elif callable(expected):
                problems = full_shape_problems(reader.shapes(), expected())
                if problems:
                    rows = "" if reader.vocab_rows is None else f"; the file holds {reader.vocab_rows} vocabulary rows"
                    raise SyncError("shape", f"{reader.path.name} does not fit the {type(engine).__name__} "
                                             f"({len(problems)} tensors, e.g. {problems[:4]}{rows}): nothing was "
                                             "loaded")
            try:
                load(reader.tensors(), reader.version)
            except SyncError:
                raise
            except (ValueError, RuntimeError) as exc:
                raise SyncError("apply", f"the engine refused {reader.path.name}: {exc}") from exc
        anchor = reader.anchor
        self._verified.add(anchor["epoch"])
        logger.info("engine reloaded the full weights at version %d from %s", reader.version, reader.path.name)
        return anchor

    def _full_path(self, full: Mapping[str, str]) -> Path:
        """Where a marker's ``full`` entry points (its own directory or a sibling's)."""
        return Path(os.path.normpath(self.dir / full["file"]))

    def _anchor_for(self, version: Optional[int]) -> dict:
        anchors = self.anchors()
        if not anchors:
            self._not_a_root(self._entries())
            raise SyncError("anchor", f"no anchor markers in {self.dir}")
        if version is None:
            return anchors[-1]
        for a in anchors:
            if a["version"] == version:
                return a
        raise SyncError("anchor", f"no anchor marker for version {version} in {self.dir} "
                                  f"(anchors at {[a['version'] for a in anchors]})")

    def _reload_advice(self, anchors: list[dict], versions: Optional[list[int]] = None) -> str:
        """How a consumer that cannot extend the chain gets back on it: the newest anchor's full weights, when
        the deltas after it are all still there (else it has to wait for the producer's next refit)."""
        if not anchors:
            return f"reload the trainer's full weights by other means ({self.dir} holds no anchor)"
        newest = anchors[-1]
        v = newest["version"]
        after = [x for x in (self.versions() if versions is None else versions) if x > v]
        if after and after[0] != v + 1:
            return (f"the newest anchor's weights (version {v}) are older than the deltas left (the oldest is "
                    f"{delta_filename(after[0])}), so the chain cannot be followed from any file here: reload at the "
                    f"producer's next full refit, the newest anchor then (sync.anchor_interval <= sync.keep_deltas "
                    f"keeps a reloadable anchor in reach)")
        if newest.get("full") is not None:
            return (f"reload the trainer's full weights at version {v} from {self._full_path(newest['full'])} "
                    f"with DirectoryTransport.load_full(engine) (it accepts the anchor)")
        return (f"reload the trainer's full weights at version {v} into the engine and call accept_anchor({v}) "
                f"(the anchor at {v} has no full-weights file here)")

    # ------------------------------------------------------------------ anchors
    def write_anchor(self, version: int, fingerprint: Optional[dict[str, str]] = None, *,
                     own_engine: bool = False, full: Optional[dict] = None) -> dict:
        """Producer: write the anchor marker of ``version`` atomically (replacing an earlier marker of
        that version) and return it. Call it whenever the trainer's weights at ``version`` do not follow
        from the published chain: at every full refit and when a chain starts (after :meth:`clear`).

        ``fingerprint``: the trainer's ``{HF name: digest}`` of its full weights at ``version`` in the
        engine's dtype (``rl.weights.trainer_fingerprint``); None: a consumer can only verify the anchor
        with :meth:`accept_anchor`. ``own_engine=True``: this object's own consumer engine was just
        loaded with exactly those weights (the in-process use), so the anchor counts as verified here.
        ``full``: what :meth:`FullWeightsWriter.finish` returned for ``version`` (``{"file", "sha256"}``), so a
        consumer can reload these weights (:meth:`load_full`); every other full-weights file in this directory
        is then deleted (only the newest anchor's is kept). ``file`` may also name the file another rank's
        chain wrote, by a path relative to this directory, ``../<its directory>/full_<version>.safetensors``
        (``sync.full_weights=first_rank``): every full-weights file here is then deleted. None: the marker
        names no file (older ones are deleted too).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SyncError("config", f"anchor version must be an int >= 0, got {version!r}")
        marker = {"version": version, "epoch": uuid.uuid4().hex,
                  "fingerprint": None if fingerprint is None else dict(sorted(fingerprint.items()))}
        if full is not None:
            marker["full"] = dict(full)
        if not _valid_marker(marker):
            raise SyncError("config", "an anchor fingerprint must map tensor names to digest strings, and its full "
                                      f"weights be {{'file': {full_filename(version)!r} (or "
                                      f"'../<directory>/{full_filename(version)}'), 'sha256': hex}}")
        _write_atomically(self.dir / anchor_filename(version), json.dumps(marker, sort_keys=True).encode())
        fsync_dir(self.dir)
        if own_engine:
            self._verified.add(marker["epoch"])
        own = full is not None and full["file"] == full_filename(version)
        for v in self.full_files():  # after the marker: a consumer of the previous marker found its file until now
            if not own or v != version:
                (self.dir / full_filename(v)).unlink(missing_ok=True)
        logger.info("anchor at version %d written (epoch %s%s)", version, marker["epoch"],
                    f", full weights {full['file']}" if full else "")
        return marker

    def anchors(self) -> list[dict]:
        """The anchor markers in the directory (``version``, ``epoch``, ``fingerprint``), ascending by
        version. An unreadable or malformed marker raises ``SyncError("anchor")`` naming it: a consumer
        does not guess past an anchor."""
        out = []
        for entry in sorted(self._entries()):
            m = _ANCHOR_RE.match(entry)
            if not m:
                continue
            try:
                marker = json.loads((self.dir / entry).read_bytes())
            except FileNotFoundError:  # removed by a producer's clear/prune meanwhile
                continue
            except (OSError, ValueError) as exc:
                raise SyncError("anchor", f"{entry}: cannot be read as an anchor marker "
                                          f"({type(exc).__name__})") from None
            if not _valid_marker(marker) or marker["version"] != int(m.group(1)):
                raise SyncError("anchor", f"{entry} is not an anchor marker of version {int(m.group(1))} "
                                          f"(a JSON object with exactly {sorted(_ANCHOR_KEYS)}, optionally "
                                          f"{sorted(_ANCHOR_OPTIONAL)})")
            out.append(marker)
        return sorted(out, key=lambda a: a["version"])

    def accept_anchor(self, version: int) -> dict:
        """Consumer: the engine now holds the trainer's full weights of the anchor at ``version``
        (reloaded by other means, its ``weight_version`` set to ``version``): count that anchor as
        verified and return it. Raises ``SyncError("anchor")`` when there is no anchor at ``version``."""
        anchor = self._anchor_for(version)
        self._verified.add(anchor["epoch"])
        return anchor

    def verify_anchor(self, engine: DeltaConsumer) -> None:
        """Check that ``engine`` may extend the chain from its ``weight_version`` (what :meth:`consume`
        does before every delta; call it before :meth:`poll` to verify by fingerprint). Raises
        ``SyncError("anchor")`` as described in the module docstring."""
        self._check_anchor(engine.weight_version, engine, self.anchors())

    def _check_anchor(self, version: int, engine: Optional[DeltaConsumer], anchors: list[dict]) -> None:
        """Pass if the newest anchor at or below ``version`` is verified, or is at ``version`` and the
        engine's fingerprint equals the marker's (then it counts as verified); ``engine=None`` verifies
        nothing new. No anchor at or below ``version``: nothing to verify."""
        below = [a for a in anchors if a["version"] <= version]
        if not below or below[-1]["epoch"] in self._verified:
            return
        anchor = below[-1]
        how = self._reload_advice(anchors)
        if anchor["version"] < version:
            raise SyncError("anchor", f"the trainer's weights were anchored at version {anchor['version']} (epoch "
                                      f"{anchor['epoch'][:12]}), which this engine (at version {version}) passed "
                                      f"without verifying: its weights may come from another trajectory (a trainer "
                                      f"resume or full refit); {how}")
        fp = None
        if engine is not None and callable(getattr(engine, "fingerprint", None)):
            fp = engine.fingerprint()
        if fp is None or anchor["fingerprint"] is None:
            why = ("the marker holds no fingerprint" if anchor["fingerprint"] is None else
                   "no engine to fingerprint (poll)" if engine is None else "the engine cannot fingerprint its weights")
            raise SyncError("anchor", f"the anchor at version {version} (epoch {anchor['epoch'][:12]}) cannot be "
                                      f"verified ({why}); {how}")
        mismatched = drift(anchor["fingerprint"], fp)
        salts = fingerprint_salt(anchor["fingerprint"]), fingerprint_salt(fp)
        if mismatched and salts[0] != salts[1]:
            raise SyncError("anchor", f"the anchor at version {version} (epoch {anchor['epoch'][:12]}) cannot be verified "
                                      f"by fingerprint: the engine samples its rows with salt {salts[1]}, the trainer's "
                                      f"marker with salt {salts[0]} (both sides salt with the weight version); {how}")
        if mismatched:
            raise SyncError("anchor", f"the engine's weights at version {version} differ from the trainer's anchor at "
                                      f"that version (epoch {anchor['epoch'][:12]}) in {len(mismatched)} tensors (e.g. "
                                      f"{mismatched[0]}): the trainer refit or restarted there; {how}")
        self._verified.add(anchor["epoch"])
        logger.info("anchor at version %d verified by fingerprint", version)

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
    def versions(self) -> list[int]:
        """Published ``new_version`` numbers, ascending (temporary files ignored)."""
        out = []
        for entry in self._entries():
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
