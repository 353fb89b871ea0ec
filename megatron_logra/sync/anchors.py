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
``DirectoryTransport`` adds the delta chain (publish, prune, read, consume) on top. This module verifies
anchors; writing and reading the markers, and the bounded set of verified ones, are
:mod:`~megatron_logra.sync.anchor_markers`'s, the full-weights files :mod:`~megatron_logra.sync.anchor_full`'s,
and the names and patterns of every kind of file in the directory :mod:`~megatron_logra.sync.directory_files`'s.

Imports only torch, safetensors (via the full-weights reader) and the standard library.
"""

from __future__ import annotations

import logging
from typing import Optional

from megatron_logra.sync.anchor_full import _FullWeightsFiles
from megatron_logra.sync.directory_files import anchor_filename, delta_filename, full_filename
from megatron_logra.sync.engine import DeltaConsumer
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.fingerprint import drift, fingerprint_salt

logger = logging.getLogger(__name__)

__all__ = ["AnchorDirectory", "delta_filename", "anchor_filename", "full_filename", "newest_epoch", "other_chain"]


def newest_epoch(anchors: list[dict], version: int) -> Optional[str]:
    """The epoch of the newest of ``anchors`` (markers, ascending) at or below ``version``: the chain a delta from
    ``version`` continues (None without one)."""
    below = [a for a in anchors if a["version"] <= version]
    return below[-1]["epoch"] if below else None


def other_chain(delta, version: int, anchors: list[dict]) -> str:
    """Why ``delta`` (from ``version``) does not continue the chain of ``anchors``: it names another anchor epoch
    than the newest anchor at or below ``version`` (a delta of another run, or of an abandoned trajectory, whose
    versions happen to fit); ``""`` when it does, or when it or the directory names no chain."""
    epoch = newest_epoch(anchors, version)
    if delta.chain is None or epoch is None or delta.chain == epoch:
        return ""
    return (f"continues the chain of anchor epoch {delta.chain}, but the chain here runs from the anchor at or below "
            f"version {version} (epoch {epoch}): a delta of another run or of an abandoned trajectory")


class AnchorDirectory(_FullWeightsFiles):
    """A delta directory's listing, anchor markers (producer: ``write_anchor``; consumer: ``anchors``,
    ``accept_anchor``, ``verify_anchor``) and full-weights files (producer: ``full_writer``, ``write_full``;
    consumer: ``open_full``, ``load_full``). The base of :class:`~megatron_logra.sync.transport.
    DirectoryTransport`, which adds the delta chain."""

    def _reload_advice(self, anchors: list[dict], versions: Optional[list[int]] = None) -> str:
        """How a consumer that cannot extend the chain gets back on it: the newest anchor's full weights, when
        the deltas after it are all still there (else it has to wait for the producer's next refit)."""
        if not anchors:
            return f"reload the trainer's full weights by other means ({self.dir} holds no anchor)"
        newest = anchors[-1]
        v = newest["version"]
        after = [x for x in (self.versions() if versions is None else versions) if x > v]
        present = set(after)
        missing = next((x for x in range(v + 1, max(after, default=v)) if x not in present), None)
        if missing is not None:
            gone = (f"are older than the deltas left (the oldest is {delta_filename(after[0])})" if missing == v + 1
                    else f"are followed by a hole in the deltas ({delta_filename(missing)} is missing)")
            return (f"the newest anchor's weights (version {v}) {gone}, so the chain cannot be followed from any file "
                    f"here: reload at the producer's next full refit, the newest anchor then (sync.anchor_interval <= "
                    f"sync.keep_deltas keeps a reloadable anchor in reach)")
        if newest.get("full") is not None:
            return (f"reload the trainer's full weights at version {v} from {self._full_path(newest['full'])} "
                    f"with DirectoryTransport.load_full(engine) (it accepts the anchor)")
        return (f"reload the trainer's full weights at version {v} into the engine and call accept_anchor({v}) "
                f"(the anchor at {v} has no full-weights file here)")

    def _reachable(self, anchor: dict, versions: Optional[list[int]] = None) -> bool:
        """Whether the chain can be followed from ``anchor``'s weights: the delta files after its version are
        contiguous from the next version (none yet counts: the next one may still be published)."""
        v = anchor["version"]
        after = [x for x in (self.versions() if versions is None else versions) if x > v]
        return after == list(range(v + 1, v + 1 + len(after)))

    # ------------------------------------------------------------------ verifying anchors
    def verify_anchor(self, engine: DeltaConsumer) -> None:
        """Check that ``engine`` may extend the chain from its ``weight_version`` (what :meth:`consume`
        does before every delta; call it before :meth:`poll` to verify by fingerprint). Raises
        ``SyncError("anchor")`` as described in the module docstring."""
        self._check_anchor(engine.weight_version, engine, self.anchors(since=engine.weight_version))

    def _check_anchor(self, version: int, engine: Optional[DeltaConsumer], anchors: list[dict]) -> None:
        """Pass if the newest anchor at or below ``version`` is verified, or is at ``version`` and the
        engine's fingerprint equals the marker's (then it counts as verified); ``engine=None`` verifies
        nothing new. No anchor at or below ``version``: nothing to verify. A negative ``version`` (an engine
        whose full load failed part-way, ``weight_version = -1``) is refused while there is an anchor to reload."""
        if version < 0 and anchors:
            raise SyncError("anchor", f"the engine's weight version is {version} (unknown: a full-weights load "
                                      f"failed part-way and left its weights partly replaced); "
                                      f"{self._reload_advice(anchors)}")
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

    def _on_chain(self, engine: DeltaConsumer, anchors: list[dict]) -> bool:
        """Whether the engine's weights are the trainer's at its version (the anchor at or below it is verified,
        by fingerprint if need be): reloading an anchor the chain cannot be followed from would only take them
        back to older weights. An engine at no anchor's chain, or whose last reload failed, is not."""
        version = engine.weight_version
        if version < 0 or not any(a["version"] <= version for a in anchors):
            return False
        try:
            self._check_anchor(version, engine, anchors)
        except SyncError:
            return False
        return True
