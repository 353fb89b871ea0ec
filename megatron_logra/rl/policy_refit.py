"""Full refits of policy sync (:class:`FullRefit`) and the delta directory's chain around them.

A full refit streams every trainer weight into the engine (``rl.weights.iter_hf_params``), one full
tensor at a time. It is the safety net of delta sync: :class:`~megatron_logra.rl.policy_sync.PolicySync`
refits at the start of the run, at ``anchor_interval``, after a master re-anchor, a detected drift or
a rejected delta.

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
from typing import Any, Iterator, Optional

import torch

from megatron_logra.parallel import ParallelGroups, all_gather_bytes, world_group
from megatron_logra.rl.policy_collectives import any_rank
from megatron_logra.rl.weights import hf_param_specs, iter_hf_params, trainer_fingerprint
from megatron_logra.sync import DirectoryTransport, SyncError
from megatron_logra.sync.config import SyncConfig
from megatron_logra.sync.fingerprint import combined

logger = logging.getLogger(__name__)

__all__ = ["FullRefit"]


class FullRefit:
    """The full-refit side of :class:`~megatron_logra.rl.policy_sync.PolicySync` (a mixin: the sync sets
    ``cfg``, ``model``, ``model_cfg``, ``engine``, ``groups``, ``transport``, ``_writes_full`` and
    ``_chain_started`` in its constructor)."""

    cfg: SyncConfig
    model: Any
    model_cfg: Any
    engine: Any
    groups: ParallelGroups
    transport: Any
    _writes_full: bool
    _chain_started: bool

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
            if any_rank(unwritable is not None):
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
