"""Trainer side of policy sync: after each update, bring the rollout engine to the new policy.

``delta`` mode (LoGRA): the step's factors ``U = quantize_factor(α·D)`` are merged into the
trainer's weights *and* shipped to the engine, which regenerates ``A`` from the seed and runs
the same merge (:mod:`megatron_logra.sync`), so both sides hold bitwise-equal weights. A
fingerprint of sampled rows is compared at every weight version that is a multiple of
``check_interval`` (rows sampled with the version as salt when the engine salts its fingerprint, so
successive checks sweep every row); a mismatch (or a version that is a multiple of ``anchor_interval``) triggers a
full refit, the safety net. Both are keyed by the weight version, which the RL state checkpoints,
so a resumed run checks and re-anchors at the same updates as an uninterrupted one. With fp32
masters the compute weights replay the engine's merges while the masters keep the exact trajectory; once
they separate by more than ``max_master_drift`` the masters are copied back and the engine refit.
``full`` mode and other optimizers refit densely. Under pipeline parallelism each stage builds the
part of its own layers; the parts are gathered over the pipeline group and merged.

An engine that one rank drives declares ``receives_weights`` (:class:`~megatron_logra.rollout.
sglang_engine.SGLangEngine`: True on the rank that drives SGLang, False on the others). Only the
driving rank builds the payload -- the other ranks skip the encode, the pipeline merge and the
checksums, about 1 GB of host bytes per rank and update at 27B, and a pipeline group without a
driving rank exchanges nothing -- and it builds it *inside* the engine's agreement on the outcome
(``apply_sketch_delta`` takes a callable), so a failure there reaches every rank as the same
``SyncError`` and all of them fall back to a full refit together. Such engines take deltas in
process (``sync.transport=directory`` is for engines that read the files themselves). Embedded
engines receive on every rank.

With ``sync.transport=directory`` the deltas also go to files for engines that read them, and every
full refit writes the refit's full weights and an anchor marker there
(:mod:`megatron_logra.rl.policy_refit`, which holds the full refit). The collectives every rank joins
(agreeing on an outcome, the pipeline stages' delta parts) are in
:mod:`megatron_logra.rl.policy_collectives`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_logra.optim.logra import LograOptimizer
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.parallel import ParallelGroups
from megatron_logra.rl.policy_collectives import any_rank, stage_parts
from megatron_logra.rl.policy_refit import FullRefit
from megatron_logra.rl.weights import trainer_fingerprint
from megatron_logra.sync import DirectoryTransport, InProcessTransport, SyncError, decode, drift, encode
from megatron_logra.sync.config import SyncConfig
from megatron_logra.sync.fingerprint import fingerprint_salt
from megatron_logra.sync.trainer import build_delta, local_factors, merge_deltas

logger = logging.getLogger(__name__)

__all__ = ["PolicySync"]


class PolicySync(FullRefit):
    """Keeps one rollout engine at the trainer's weight version (every rank holds an engine object;
    see the module docstring for ranks whose engine is driven by another rank)."""

    def __init__(self, cfg: SyncConfig, *, model: Any, model_cfg: Any, optimizer: Any, engine: Any,
                 groups: ParallelGroups, run_dir: Path) -> None:
        self.cfg = cfg
        self.model, self.model_cfg, self.optimizer, self.engine, self.groups = model, model_cfg, optimizer, engine, groups
        self.delta_mode = cfg.mode == "delta" and isinstance(optimizer, LograOptimizer)
        self.driven = hasattr(engine, "receives_weights")  # one rank drives the engine (SGLang)
        self.receives = bool(getattr(engine, "receives_weights", True))
        if self.delta_mode and self.driven and cfg.transport == "directory":
            raise ValueError("sync.transport=directory writes deltas for an engine that reads the files itself; "
                             f"the {type(engine).__name__} takes them from its driving rank: use sync.transport=inprocess")
        if cfg.mode == "delta" and not self.delta_mode:
            logger.info("sync.mode=delta falls back to full refits with optimizer %s", type(optimizer).__name__)
        self.transport = None
        self._writes_full = False  # this rank writes the full-weights files of the directory transport
        if self.delta_mode and self.receives:
            if cfg.transport == "directory":
                root, rank = Path(cfg.directory or run_dir / "deltas"), torch.distributed.get_rank()
                claimed: Optional[SyncError] = None
                try:
                    self.transport = DirectoryTransport(root / f"rank{rank}")
                    self.transport.claim()  # one trainer per chain: a second run here is refused
                except SyncError as exc:
                    claimed = exc
                if any_rank(claimed is not None):  # every rank stops, none waits in a collective
                    raise claimed or SyncError("config", "another rank cannot write its delta directory under "
                                                         f"{root} (see that rank's error)")
                # every rank's chain holds the same weights at a refit: one file serves all (sync.full_weights)
                self._writes_full = cfg.full_weights == "all" or (cfg.full_weights == "first_rank" and rank == 0)
                # the chain (re)starts at the first full refit, at the run's weight version (``_start_chain``)
                if cfg.keep_deltas and not 0 < cfg.anchor_interval <= cfg.keep_deltas and rank == 0:
                    logger.warning("sync: sync.anchor_interval=%d with sync.keep_deltas=%d: a consumer of %s that "
                                   "falls more than %d updates behind cannot reload and rejoin until a full refit "
                                   "lands within the deltas kept (only drift repairs and master re-anchors refit); "
                                   "set sync.anchor_interval=%d (<= sync.keep_deltas) to keep one in reach, or "
                                   "sync.keep_deltas=0 to keep every delta", cfg.anchor_interval, cfg.keep_deltas,
                                   root, cfg.keep_deltas, cfg.keep_deltas)
            else:
                self.transport = InProcessTransport(engine)
        self.num_syncs = 0
        self.num_drifts = 0
        self._chain_started = False

    # ------------------------------------------------------------------ per update
    def factors(self, update: PreparedUpdate, alpha: float) -> Optional[dict[str, torch.Tensor]]:
        """The factors the optimizer must merge (``None``: use its own arithmetic, refit densely)."""
        if not self.delta_mode or update.skipped:
            return None
        return local_factors(self.optimizer, update, alpha)

    def push(self, update: PreparedUpdate, alpha: float, factors: Optional[dict[str, torch.Tensor]],
             base_version: int, new_version: int) -> dict:
        """Send the applied update to the engine; returns ``sync_bytes``, ``sync_mode`` and ``sync_drift``."""
        self.num_syncs += 1
        # keyed by the weight version (restored on resume), not by syncs since this process started: a
        # resumed run re-anchors and checks at the very updates an uninterrupted one does
        anchor = bool(self.cfg.anchor_interval) and new_version % self.cfg.anchor_interval == 0
        if factors is None:
            return {"sync_bytes": self.full(new_version), "sync_mode": "full", "sync_drift": 0, "sync_master_drift": 0.0}
        delta = build_delta(self.optimizer, update, alpha, base_version, new_version, self.groups,
                            model=self.model, factors=factors)
        parts = stage_parts(delta, self.groups, self.receives)
        sent = [0]

        def payload() -> bytes:  # the whole step's delta, on a receiving rank
            data = encode(delta) if parts is None else encode(merge_deltas([decode(part) for part in parts]))
            sent[0] = len(data)
            return data

        failure: Optional[SyncError] = None
        unwritable: Optional[SyncError] = None
        try:
            if self.driven:  # the driving rank builds and sends inside the engine's agreement; others wait in it
                self.engine.apply_sketch_delta(payload if self.receives else None)
            elif isinstance(self.transport, DirectoryTransport):
                try:
                    if not self._chain_started:  # no refit yet: the chain starts here, anchored without weights
                        self._start_chain(base_version)
                        self.transport.write_anchor(base_version, None, own_engine=True)
                    sent[0] = self.transport.publish(payload()).stat().st_size  # as written: it names its chain
                except OSError as exc:  # a full disk, a read-only filesystem: not the engine's rejection
                    unwritable = self._unwritable(f"the delta {base_version}->{new_version}", exc)
                    raise unwritable from None
                self.transport.consume(self.engine)
                if self.cfg.keep_deltas:  # 0 keeps every file
                    self.transport.prune(new_version - self.cfg.keep_deltas + 1)
            else:
                self.transport.send(payload())
        except SyncError as exc:  # the engine kept its weights
            failure = exc
        any_failure = any_rank(failure is not None)
        if any_failure and any_rank(unwritable is not None):  # the run stops on every rank together
            raise unwritable or SyncError("unwritable", "another rank could not write its delta file (see its error); "
                                                        "free the space there and continue with --resume RUN_DIR")
        if any_failure:  # bring the engines back with a dense refit, all ranks together
            logger.warning("sync: %s delta %d->%d (%s); full refit",
                           "the engine rejected" if failure else "another rank's engine rejected", base_version,
                           new_version, failure or "see that rank's log")
            self.num_drifts += 1
            return {"sync_bytes": sent[0] + self.full(new_version), "sync_mode": "full", "sync_drift": 1,
                    "sync_master_drift": 0.0}
        mode, drifted = "delta", 0
        if self.cfg.check_interval and new_version % self.cfg.check_interval == 0:
            engine_fp = self.engine.fingerprint()  # None: the engine cannot fingerprint (anchor refits only)
            # an engine that salts its row sample does so with its weight version: the trainer samples the rows of
            # ``new_version`` (an engine at another version then differs); an unsalted engine, the fixed rows
            salt = None if fingerprint_salt(engine_fp) is None else new_version
            mismatched = [] if engine_fp is None else \
                drift(trainer_fingerprint(self.model, self.groups, self.model_cfg, dtype=self.model_cfg.torch_dtype,
                                          vocab_rows=getattr(self.engine, "fingerprint_vocab_rows", None), salt=salt),
                      engine_fp)
            if any_rank(bool(mismatched)):
                drifted = 1
                self.num_drifts += 1
                logger.warning("sync: engine weights drifted from the trainer's in %d tensors (e.g. %s); "
                               "full refit", len(mismatched), mismatched[0] if mismatched else "on another rank")
        master_drift = self.optimizer.master_drift()
        if self.optimizer.masters and (anchor or 0 < self.cfg.max_master_drift < master_drift):
            self.optimizer.reanchor()
            anchor = True
        if drifted or anchor:
            self.full(new_version)
            mode = "delta+anchor"
        return {"sync_bytes": sent[0], "sync_mode": mode, "sync_drift": drifted, "sync_master_drift": master_drift}
