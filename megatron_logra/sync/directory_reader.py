"""The consumer's half of a delta directory: read the chain after an engine's version and apply it.

A consumer reads one delta file at a time (one decoded delta in memory), checks that it extends the chain
(``version``: it forks from or overlaps it; ``gap``: a missing version with nothing before it), and checks
the anchors at each delta's base version before handing it out (``anchor``: see
:mod:`megatron_logra.sync.anchors`). :meth:`_DirectoryReader.consume` applies the deltas to an engine;
:meth:`_DirectoryReader.follow` (:mod:`megatron_logra.sync.directory_follow`) is one step of a consumer loop,
reloading the newest anchor's full weights at most once per anchor when the chain refuses the engine. Any ``SyncError`` leaves the engine as the last
successful apply or reload left it. The whole protocol is described in
:mod:`megatron_logra.sync.transport`'s docstring.

Imports only torch, safetensors (via the codec) and the standard library.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator, Optional, Union

from megatron_logra.sync.anchors import AnchorDirectory, other_chain
from megatron_logra.sync.codec import SketchDelta, decode
from megatron_logra.sync.directory_follow import AnchorFollower
from megatron_logra.sync.directory_files import _FILE_RE, delta_filename
from megatron_logra.sync.engine import DeltaConsumer
from megatron_logra.sync.errors import SyncError

logger = logging.getLogger(__name__)


class _DirectoryReader(AnchorFollower, AnchorDirectory):
    """The consumer's side of a delta directory: ``read``, ``poll``, ``consume``, ``follow`` (from
    :class:`~megatron_logra.sync.directory_follow.AnchorFollower`) and, from
    :class:`~megatron_logra.sync.anchors.AnchorDirectory`, ``verify_anchor``, ``accept_anchor``,
    ``load_full``."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        super().__init__(directory)
        self._reloaded: Optional[str] = None  # epoch of the anchor follow() last reloaded

    # ------------------------------------------------------------------ consumer
    def read(self, version: int) -> SketchDelta:
        """Decode the delta published as ``version`` (``SyncError`` names the file on corruption)."""
        path = self.dir / delta_filename(version)
        try:
            data = path.read_bytes()
        except OSError as exc:  # a folder or a dangling link in its place, permissions: unreadable, not a crash
            raise SyncError("unreadable", f"{path}: cannot be read ({type(exc).__name__}: {exc.strerror})") from None
        try:
            return decode(data)
        except SyncError as exc:
            raise SyncError(exc.kind, f"{path}: {str(exc).removeprefix(f'[{exc.kind}] ')}") from None

    def _bad_file(self, exc: SyncError, v: int, expected: int, anchors: list[dict], versions: list[int]) -> SyncError:
        """``exc`` (a delta file that cannot extend the chain: corrupt, unreadable, holding another version or
        forking from the chain) with what the consumer can do about it appended."""
        path = self.dir / delta_filename(v)
        newest = anchors[-1] if anchors else None
        if (newest is not None and newest.get("full") is not None and newest["version"] >= v
                and self._reachable(newest, versions)):
            how = (f"the newest anchor (version {newest['version']}) is past it: follow(engine) reloads its full "
                   f"weights, {self._full_path(newest['full'])}, and goes on from there")
        else:
            how = (f"the trainer never rewrites a published delta: put the trainer's own {path.name} back in its "
                   "place, or wait for the trainer's next full refit past it (sync.anchor_interval), whose full "
                   "weights follow(engine) reloads")
        return SyncError(exc.kind, f"{str(exc).removeprefix(f'[{exc.kind}] ')}; this engine stays at version "
                                   f"{expected} (the deltas before {path.name} stay applied); {how}")

    def _chain(self, current_version: int, engine: Optional[DeltaConsumer] = None) -> Iterator[SketchDelta]:
        """Yield the deltas after ``current_version`` in order, reading each file only when the
        previous one has been taken (one decoded delta in memory at a time).

        Raises at the first file that cannot extend the chain: unreadable or corrupt (the
        decode's kind, naming the file), holding another version (``version``), starting
        below the chain (``version``: it forks from or overlaps the chain), or naming another chain than the
        newest anchor at or below its base version (``version``: another run's delta whose versions fit). At a missing
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
        # after the listing: an anchor written before a listed delta is seen; from the engine's own anchor on
        anchors = self.anchors(since=current_version)
        for v in versions:
            if v <= current_version:
                continue
            try:
                delta = self.read(v)
            except SyncError as exc:
                if os.path.lexists(self.dir / delta_filename(v)):
                    raise self._bad_file(exc, v, expected, anchors, versions) from None
                msg = (f"{delta_filename(v)} was removed from {self.dir} while this consumer (at version {expected}) "
                       f"read the chain (pruned, sync.keep_deltas, or cleared by a trainer restart)")
                if yielded:
                    logger.warning("%s; stopping after the %d deltas before it", msg, yielded)
                    return
                raise SyncError("gap", f"{msg}; this engine cannot catch up through deltas: "
                                       f"{self._reload_advice(self.anchors(since=expected))}") from None
            if delta.new_version != v:
                raise self._bad_file(SyncError("version", f"{self.dir / delta_filename(v)} holds the delta "
                                                          f"{delta.base_version}->{delta.new_version}, not version {v} "
                                                          "(renamed or copied there)"),
                                     v, expected, anchors, versions)
            if delta.base_version < expected:
                raise self._bad_file(SyncError("version", f"{self.dir / delta_filename(v)} is the delta "
                                                          f"{delta.base_version}->{v} but the chain is already at "
                                                          f"{expected}: it forks from or overlaps the chain"),
                                     v, expected, anchors, versions)
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
                else:  # a later file is there: the trainer publishes in version order, the missing ones will not come
                    msg = (f"{msg} (removed from {self.dir}, or versions the trainer reached by a full refit); this "
                           f"engine cannot catch up through deltas: {self._reload_advice(anchors, versions)}")
                raise SyncError("gap", msg)
            try:
                self._check_anchor(expected, engine, anchors)
            except SyncError as exc:
                if yielded and engine is None:  # poll: the caller verifies the anchor at `expected` first
                    logger.warning("%s; stopping after the %d deltas before it", exc, yielded)
                    return
                raise
            foreign = other_chain(delta, expected, anchors)
            if foreign:
                raise self._bad_file(SyncError("version", f"{self.dir / delta_filename(v)} {foreign}"), v, expected,
                                     anchors, versions)
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
