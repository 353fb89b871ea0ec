"""Anchor markers and full-weights files of a delta directory: the part of
:class:`~megatron_logra.sync.transport.DirectoryTransport` that names a trajectory.

Version numbers alone do not name a trajectory: a trainer that resumes from an earlier checkpoint starts
a new chain at a version a consumer may already have passed, and a trainer's full refit (anchor,
re-anchor, drift repair) changes its weights without a delta. So the producer also writes an **anchor
marker** ``anchor_{version:08d}.json`` (atomically; JSON: ``version``, a fresh random ``epoch`` id, and
the trainer's ``fingerprint`` of its full weights at that version in HF names and the engine's dtype, or
null; optionally ``full``, the refit's full-weights file) at every full refit and when its chain starts.
A consumer applies a delta only after it has *verified* the newest anchor at or below its version (by
fingerprint at exactly that version, by :meth:`AnchorDirectory.accept_anchor`, or by reloading the
anchor's full weights with :meth:`AnchorDirectory.load_full`); the rules are in
:mod:`megatron_logra.sync.transport`'s docstring.

:class:`AnchorDirectory` holds the directory listing, the markers and the full-weights files;
``DirectoryTransport`` adds the delta chain (publish, prune, read, consume) on top. The file names and
patterns of every kind of file in the directory live here.

Imports only torch, safetensors (via the full-weights reader) and the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.sync.engine import DeltaConsumer, full_shape_problems
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.fingerprint import drift, fingerprint_salt
from megatron_logra.sync.full_weights import FullWeightsReader, FullWeightsWriter, full_filename, fsync_dir

logger = logging.getLogger(__name__)

__all__ = ["AnchorDirectory", "delta_filename", "anchor_filename", "full_filename"]

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
_VERIFIED_SWEEP = 64
"""Verified epochs an :class:`AnchorDirectory` keeps before it drops those of markers no longer in the directory."""


def delta_filename(new_version: int) -> str:
    return f"delta_{new_version:08d}.safetensors"


def anchor_filename(version: int) -> str:
    return f"anchor_{version:08d}.json"


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


class AnchorDirectory:
    """A delta directory's listing, anchor markers (producer: ``write_anchor``; consumer: ``anchors``,
    ``accept_anchor``, ``verify_anchor``) and full-weights files (producer: ``full_writer``, ``write_full``;
    consumer: ``open_full``, ``load_full``). The base of :class:`~megatron_logra.sync.transport.
    DirectoryTransport`, which adds the delta chain."""

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
        self._verified_limit = _VERIFIED_SWEEP

    def _remember(self, epoch: str) -> None:
        """Count the anchor of ``epoch`` as verified. Only markers still in the directory can be asked about
        (a marker rewritten at a version gets a new epoch), so once the set outgrows the limit it keeps only
        the epochs of those markers: a run that writes an anchor every few versions for weeks holds a bounded
        set, not one entry per anchor ever written."""
        self._verified.add(epoch)
        if len(self._verified) <= self._verified_limit:
            return
        try:
            present = {a["epoch"] for a in self.anchors()}
        except SyncError:  # unreadable now: keep everything, try again at the next anchor
            return
        self._verified &= present | {epoch}
        self._verified_limit = max(_VERIFIED_SWEEP, 2 * len(self._verified))

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

    def versions(self) -> list[int]:
        """Published ``new_version`` numbers, ascending (temporary files ignored)."""
        out = []
        for entry in self._entries():
            m = _FILE_RE.match(entry)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

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
        self._remember(anchor["epoch"])
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
            self._remember(marker["epoch"])
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
        self._remember(anchor["epoch"])
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
        self._remember(anchor["epoch"])
        logger.info("anchor at version %d verified by fingerprint", version)
