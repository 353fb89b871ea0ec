"""Anchor markers of a delta directory (writing and reading them) and the bounded set of verified anchors.

The producer writes an anchor marker (:meth:`_AnchorMarkers.write_anchor`) whenever its weights at a
version do not follow from the published chain; a consumer reads them (:meth:`_AnchorMarkers.anchors`:
a malformed one raises, a consumer does not guess past an anchor) and counts the ones it verified by the
marker's random ``epoch``, which a marker rewritten at the same version does not share. That set is
bounded: past :data:`_VERIFIED_SWEEP` epochs it keeps only those of markers still in the directory (only
they can be asked about), so a run anchoring every few versions for weeks does not grow it without end.
How a consumer verifies an anchor is :mod:`megatron_logra.sync.anchors`'s; the rules are in
:mod:`megatron_logra.sync.transport`'s docstring.

Imports only the standard library besides the sync package.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from megatron_logra.sync.directory_files import (_ANCHOR_KEYS, _ANCHOR_OPTIONAL, _ANCHOR_RE, _FILE_RE, _FULL_RE,
                                                 _RANK_DIR_RE, _valid_marker, _write_atomically, anchor_filename)
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights import full_filename, fsync_dir

logger = logging.getLogger(__name__)

_VERIFIED_SWEEP = 64
_UNREADABLE_MARKER = ("a consumer does not pass an anchor it cannot read (it may announce a refit or a trainer "
                      "restart): the trainer's next full refit writes a newer one, which DirectoryTransport.follow "
                      "reloads")
"""Verified epochs an :class:`AnchorDirectory` keeps before it drops those of markers no longer in the directory."""


class _AnchorMarkers:
    """A delta directory's listing and anchor markers (producer: ``write_anchor``; consumer: ``anchors``,
    ``accept_anchor``), and the epochs of the anchors this object verified (or wrote for its own engine)."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise SyncError("config", f"delta directory {self.dir} exists and is not a directory")
        # a producer's claim() raises this; a consumer (read-only access suffices) waits for a trainer to create it
        self._uncreatable: Optional[str] = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only or full filesystem, no permission
            self._uncreatable = (f"cannot create the delta directory {self.dir} ({type(exc).__name__}: "
                                 f"{exc.strerror or exc}): create it, or choose a writable sync.directory")
        self._verified: set[str] = set()  # epochs of the anchors this object's consumer verified (or wrote)
        self._verified_limit = _VERIFIED_SWEEP
        self._written: Optional[tuple[int, str]] = None  # (version, epoch) of the newest marker this producer wrote

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

    def full_files(self) -> list[int]:
        """Versions of the full-weights files in the directory, ascending."""
        return sorted(int(m.group(1)) for m in map(_FULL_RE.match, self._entries()) if m)

    def _full_path(self, full: Mapping[str, str]) -> Path:
        """Where a marker's ``full`` entry points (its own directory or a sibling's)."""
        return Path(os.path.normpath(self.dir / full["file"]))

    def _anchor_for(self, version: Optional[int]) -> dict:
        anchors = self.anchors(since=sys.maxsize if version is None else version)
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
        self._written = (version, marker["epoch"])
        if own_engine:
            self._remember(marker["epoch"])
        own = full is not None and full["file"] == full_filename(version)
        for v in self.full_files():  # after the marker: a consumer of the previous marker found its file until now
            if not own or v != version:
                (self.dir / full_filename(v)).unlink(missing_ok=True)
        logger.info("anchor at version %d written (epoch %s%s)", version, marker["epoch"],
                    f", full weights {full['file']}" if full else "")
        return marker

    def anchors(self, since: Optional[int] = None) -> list[dict]:
        """The anchor markers in the directory (``version``, ``epoch``, ``fingerprint``), ascending by
        version. An unreadable or malformed marker raises ``SyncError("anchor")`` naming it: a consumer
        does not guess past an anchor.

        ``since``: only the markers a consumer at that version still asks about, the newest at or below it and
        those above (the versions come from the file names): the older ones are not read, so a marker no
        consumer needs any more (corrupt, say) stops nobody, and a directory holding many does not make every
        poll read them all. Past every marker (e.g. ``sys.maxsize``): the newest alone."""
        found = sorted((int(m.group(1)), entry) for m, entry in ((_ANCHOR_RE.match(e), e) for e in self._entries())
                       if m)
        start = max((v for v, _ in found if v <= since), default=None) if since is not None else None
        out = []
        for version, entry in found:
            if start is not None and version < start:
                continue
            try:
                marker = json.loads((self.dir / entry).read_bytes())
            except FileNotFoundError:  # removed by a producer's clear/prune meanwhile
                if version == start:  # the consumer's own anchor: the ones below it count again
                    return self.anchors()
                continue
            except (OSError, ValueError) as exc:
                raise SyncError("anchor", f"{self.dir / entry}: cannot be read as an anchor marker "
                                          f"({type(exc).__name__}); {_UNREADABLE_MARKER}") from None
            if not _valid_marker(marker) or marker["version"] != version:
                raise SyncError("anchor", f"{self.dir / entry} is not an anchor marker of version {version} "
                                          f"(a JSON object with exactly {sorted(_ANCHOR_KEYS)}, optionally "
                                          f"{sorted(_ANCHOR_OPTIONAL)}); {_UNREADABLE_MARKER}")
            out.append(marker)
        return out

    def accept_anchor(self, version: int) -> dict:
        """Consumer: the engine now holds the trainer's full weights of the anchor at ``version``
        (reloaded by other means, its ``weight_version`` set to ``version``): count that anchor as
        verified and return it. Raises ``SyncError("anchor")`` when there is no anchor at ``version``."""
        anchor = self._anchor_for(version)
        self._remember(anchor["epoch"])
        return anchor
