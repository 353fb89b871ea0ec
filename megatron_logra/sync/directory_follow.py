"""One step of a delta-directory consumer loop: consume, and reload the newest anchor's full weights when the chain
refuses the engine (the :class:`AnchorFollower` mixin of :class:`~megatron_logra.sync.directory_reader._DirectoryReader`).

:meth:`AnchorFollower.follow` applies the new deltas (``consume``); when that raises a ``SyncError`` that the
newest anchor's full weights can cure (an unverified anchor; a gap, or a delta file that cannot extend the chain,
with the newest anchor past the engine's version and reachable, or an engine not verified on the chain), it
reloads them (``load_full``) and consumes again. The newest anchor is reloaded at most once per object, so a loop
does not re-read a model-sized file at every poll. The host class provides ``consume``, ``load_full``, ``anchors``,
``_reachable``, ``_on_chain`` and ``_reloaded`` (the epoch of the anchor last reloaded, None at first).

Imports only torch, safetensors (via the sync package's engine side) and the standard library.
"""

from __future__ import annotations

import sys
from typing import Optional

from megatron_logra.sync.engine import DeltaConsumer
from megatron_logra.sync.errors import SyncError

__all__ = ["AnchorFollower"]


class AnchorFollower:
    """``follow``: consume, reloading the newest anchor where that helps (a mixin; see the module doc for what
    the host provides)."""

    def follow(self, engine: DeltaConsumer) -> list[int]:
        """Consumer: one step of a consumer loop; returns the versions applied. :meth:`consume`, and when it is
        refused, :meth:`load_full` of the newest anchor and :meth:`consume` again, where that reload can help:

        * ``anchor`` (the engine passed a refit or trainer restart it has not verified): always;
        * ``gap`` (the deltas it needs were pruned or removed), or a delta file that cannot extend the chain
          (corrupt, unreadable, another version, refused by the engine): when the newest anchor is past the
          engine's version and the delta files after it are contiguous, so the chain can be followed from it;
          or when the engine's weights are not verified at its version (a fresh engine). An engine on the chain
          is not taken back to an older anchor whose deltas were pruned past it.

        The newest anchor is reloaded at most once by this object: when that did not get the engine back on the
        chain the refusal is raised as it is, until the trainer writes a newer anchor, so a loop does not
        re-read a model-sized file at every poll. Every ``SyncError`` raised leaves the engine as the last
        successful apply or reload left it; call again later."""
        try:
            return self.consume(engine)
        except SyncError as exc:
            anchor = self._reload_target(exc, engine)
            if anchor is None:
                raise
        try:
            self._reloaded = self.load_full(engine, anchor["version"])["epoch"]
        except SyncError as exc:
            if exc.kind in ("shape", "layout", "config"):  # the engine cannot take this file: not at every poll
                self._reloaded = anchor["epoch"]
            raise
        return self.consume(engine)

    def _reload_target(self, exc: SyncError, engine: DeltaConsumer) -> Optional[dict]:
        """The newest anchor, when :meth:`follow` reloads its full weights after :meth:`consume` raised ``exc``."""
        if exc.kind == "config":  # not a delta directory: nothing here to reload
            return None
        try:
            newest = self.anchors(since=sys.maxsize)
            if not newest or newest[-1].get("full") is None or newest[-1]["epoch"] == self._reloaded:
                return None
            newest = newest[-1]
            if exc.kind == "anchor" or (newest["version"] > engine.weight_version and self._reachable(newest)):
                return newest
        except SyncError:  # the directory or the newest marker is unreadable now: raise the refusal itself
            return None
        try:
            anchors = self.anchors(since=engine.weight_version)
        except SyncError:  # the engine's own anchor cannot be read: it is not known to be on the chain
            return newest
        return None if self._on_chain(engine, anchors) else newest
