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

With ``sync.transport=directory`` the deltas also go to files for engines that read them
(:class:`~megatron_logra.sync.transport.DirectoryTransport`); every full refit (the start of the run,
``anchor_interval``, master re-anchors, drift repairs, refits after a rejected delta) writes the
refit's full weights (by default one file, written by rank 0 and named by every rank's marker:
``sync.full_weights``) and an anchor marker there, so such an engine refuses to apply deltas past a
refit or a trainer resume it has not verified instead of silently following another trajectory, and
gets back on the chain by loading those weights (``DirectoryTransport.load_full``). A resumed run
keeps the files up to its weight version and deletes those above it. Each rank claims its directory
(``DirectoryTransport.claim``), so a second run pointed at the same ``sync.directory`` is refused on every
rank at start. A delta or anchor marker that cannot be written (a full disk, a read-only filesystem) stops
the run on every rank with ``SyncError("unwritable")`` naming the file: a consumer cannot follow a chain
with a missing link or an unannounced refit, and ``--resume`` rewrites the chain from the checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_logra.optim.logra import LograOptimizer
from megatron_logra.optim.native import reduce_flag_any
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.parallel import ParallelGroups, all_gather_bytes, all_reduce_sum, world_group
from megatron_logra.rl.weights import hf_param_specs, iter_hf_params, trainer_fingerprint
from megatron_logra.sync import DirectoryTransport, InProcessTransport, SyncError, decode, drift, encode
from megatron_logra.sync.config import SyncConfig
from megatron_logra.sync.fingerprint import combined, fingerprint_salt
from megatron_logra.sync.trainer import build_delta, local_factors, merge_deltas

logger = logging.getLogger(__name__)

__all__ = ["PolicySync"]


class PolicySync:
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
                if self._any_rank(claimed is not None):  # every rank stops, none waits in a collective
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

    def _start_chain(self, version: int) -> None:
        """Directory transport: the trainer's chain starts (or resumes) at ``version``. The files above it
        belong to a trajectory this run abandons (an earlier run past its checkpoint) and are deleted; the
        deltas, anchors and full weights up to it stay, so a consumer behind the resume point keeps
        following them (its anchor checks end at the anchor the refit at ``version`` writes)."""
        removed = self.transport.clear(above_version=version)
        if removed:
            logger.info("sync: directory chain restarts at version %d; removed %d files above it", version,
                        len(removed))
        self._chain_started = True

    # ------------------------------------------------------------------ full refit
    def full(self, version: int) -> int:
        """Dense refit of every engine weight, streamed one full tensor at a time (``rl.weights``);
        returns the bytes a bf16 copy sends.

        With ``sync.transport=directory`` the same stream is also written, tensor by tensor, as the full
        weights ``full_<version>.safetensors`` in HF names and the engine dtype (``model.params_dtype``),
        ``embed_tokens``/``lm_head`` cut to the model's vocabulary (``model.vocab_size`` rows, as in its HF
        checkpoint), and then an anchor marker at ``version`` naming that file and carrying the trainer's
        fingerprint of the same rows (collective over the model-parallel group, like the refit): an engine that
        reads the files itself learns of the refit and can reload its weights
        (``DirectoryTransport.load_full``). ``sync.full_weights`` says which ranks write the file:
        ``first_rank`` (default), global rank 0 only, and the other ranks' markers name it (``../rank0/...``)
        after a small exchange over all ranks that tells them it was written; ``all``, every rank its own
        copy; ``none``, no rank. Only the newest full-weights file is kept. A failed write of it is logged and
        leaves the marker without a file; the refit itself goes on."""
        directory = isinstance(self.transport, DirectoryTransport)
        writer = None
        if directory:
            if not self._chain_started:
                self._start_chain(version)
            if self.cfg.full_weights != "none":
                # collective over PP, like the stream: every rank lists the tensors, the writing ones lay out the file
                specs = hf_param_specs(self.model, self.groups, self.model_cfg)
                if self._writes_full:
                    # the model's vocabulary, as its HF checkpoint (and an engine started from it) holds it
                    writer = self.transport.full_writer(version, specs, self.model_cfg.torch_dtype,
                                                        vocab_rows=self.model_cfg.vocab_size)
        sent = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in iter_hf_params(self.model, self.groups, self.model_cfg):
                sent[0] += tensor.numel() * 2
                if writer is not None:
                    writer.add(name, tensor)  # never raises: a failed write only loses the file
                yield name, tensor

        try:
            self.engine.update_weights_full(counted(), version)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if directory:
            full = None if writer is None else writer.finish()
            # the rows of the file: a separate engine verifies the anchor by fingerprint with the same rows
            fp = trainer_fingerprint(self.model, self.groups, self.model_cfg, dtype=self.model_cfg.torch_dtype,
                                     vocab_rows=self.model_cfg.vocab_size, salt=version)
            if self.cfg.full_weights == "first_rank":
                full = self._shared_full(full, fp)
            unwritable: Optional[SyncError] = None
            try:
                self.transport.write_anchor(version, fp, own_engine=True, full=full)  # this rank's engine was just refit
            except OSError as exc:  # without the marker a consumer would apply the next delta to pre-refit weights
                unwritable = self._unwritable(f"the anchor marker of the refit at version {version}", exc)
            if self._any_rank(unwritable is not None):
                raise unwritable or SyncError("unwritable", "another rank could not write its anchor marker (see its "
                                                            "error); free the space there and continue with --resume "
                                                            "RUN_DIR")
        return sent[0]

    def _unwritable(self, what: str, exc: OSError) -> SyncError:
        """The error that stops the run when ``what`` cannot be written into the delta directory."""
        error = SyncError("unwritable", f"sync.transport=directory: writing {what} into {self.transport.dir} failed "
                                        f"({type(exc).__name__}: {exc.strerror or exc}); a consumer of that directory "
                                        "cannot follow the trainer without it, so the run stops. Free space there (or "
                                        "lower sync.keep_deltas, or set sync.directory to a writable filesystem) and "
                                        "continue with megatron-logra train --resume RUN_DIR: the resumed run rewrites "
                                        "the chain from its checkpoint")
        logger.error("%s", error)
        return error

    def _shared_full(self, full: Optional[dict], fp: dict[str, str]) -> Optional[dict]:
        """``sync.full_weights=first_rank``: the full-weights file global rank 0 wrote, as this rank's marker
        names it (``../rank0/<file>`` on the other ranks), or None when rank 0 has none or its weights'
        fingerprint differs from this rank's (a marker must not name other weights). Collective over every
        rank (JSON in a byte tensor), after rank 0 finished the file, so no marker names a file that is not
        there yet."""
        mine = json.dumps({"full": full, "fp": combined(fp)}).encode()
        first = json.loads(all_gather_bytes(mine, world_group())[0].decode())
        if first["full"] is None or torch.distributed.get_rank() == 0:
            return full
        if first["fp"] != combined(fp):
            logger.error("sync: this rank's weights at the refit differ from rank 0's (fingerprint); its anchor "
                         "marker names no full-weights file")
            return None
        return {"file": f"../rank0/{first['full']['file']}", "sha256": first["full"]["sha256"]}

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
        parts = self._stage_parts(delta)
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
                    self.transport.publish(payload())
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
        any_failure = self._any_rank(failure is not None)
        if any_failure and self._any_rank(unwritable is not None):  # the run stops on every rank together
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
            if self._any_rank(bool(mismatched)):
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

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank of the job. A model-parallel group must refit together (``full``
        gathers over TP and PP): engines that each rank owns (embedded, directory transport) can
        differ, e.g. one rank out of memory, and a driven engine shares one outcome within its group
        only. Agreeing over the data-parallel replicas too keeps every replica's engine at the same
        weights and every rank's record of the sync (``sync_mode``, ``sync_drift``) the same: a drift
        in any replica shows in the metrics rank 0 writes."""
        return reduce_flag_any(flag, world_group(), torch.device("cpu"))

    def _stage_parts(self, delta: Any) -> Optional[list[bytes]]:
        """Under pipeline parallelism, every stage's encoded part of the step's delta (collective over
        the PP group; exchanged only when some rank of the group receives, and gathered to that rank
        alone when it is the only one); None at PP = 1, on a rank whose group has no receiver, or on a
        non-receiving rank of a group with one receiver. A part that cannot be encoded travels empty, so the
        receiving rank's decode rejects it (one ``SyncError`` for everyone) instead of a rank
        leaving the collective."""
        if self.groups.pp_size == 1:
            return None
        wanted = torch.zeros(self.groups.pp_size, dtype=torch.float64)
        wanted[self.groups.pp_rank] = float(self.receives)
        receivers = [i for i, w in enumerate(all_reduce_sum(wanted, self.groups.pp).tolist()) if w]
        if not receivers:
            return None
        try:
            mine = encode(delta)
        except SyncError as exc:
            logger.warning("sync: this stage's delta part cannot be encoded (%s)", exc)
            mine = b""
        if len(receivers) > 1:  # engines each rank owns: every stage needs every part
            return all_gather_bytes(mine, self.groups.pp)
        # one driving rank: only it collects the parts (the other stages hold no copy of the step's delta)
        gathered: Optional[list] = [None] * self.groups.pp_size if self.receives else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(self.groups.pp, receivers[0]), group=self.groups.pp)
        return gathered
