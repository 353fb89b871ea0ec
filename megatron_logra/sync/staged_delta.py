"""A sketch delta staged against an engine's weights: the write half of :func:`megatron_logra.sync.apply.apply_delta_`.

Contract: a :class:`StagedDelta` holds everything :func:`~megatron_logra.sync.apply.stage_delta`
validated and allocated (the prepared commit, the engine weights it writes, ``V``, the rounding noise
or the CUDA-graph inputs, the dense casts); :meth:`StagedDelta.commit_` writes it once with in-place
kernels only (no allocation), refusing a stage already committed or one the
:class:`~megatron_logra.sync.projection_cache.ProjectionCache` has moved past. Re-exported by
:mod:`megatron_logra.sync.apply`, where staging lives.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.precision import ieee_fp32
from megatron_logra.sync.prepared_commit import PreparedCommit
from megatron_logra.sync.projection_cache import ProjectionCache

logger = logging.getLogger("megatron_logra.sync.apply")  # the apply's log, as before the split

__all__ = ["StagedDelta"]


class StagedDelta:
    """A delta validated and prepared against one engine's weights: everything of an apply but the writes.

    :func:`stage_delta` makes it; :meth:`commit_` writes it (once). Between the two nothing may
    write the staged weights or stage another delta through the same :class:`ProjectionCache` (its
    fixed-address inputs are shared): :meth:`commit_` refuses a stage the cache has moved past. The
    split lets a sharded engine agree across its TP ranks that every rank validated *and* allocated
    (projections, ``V``, workspaces, dense casts) before any rank writes, so an allocation failure on
    one rank leaves all of them untouched instead of some committed (see
    :mod:`megatron_logra.sync.sglang_loader`).
    """

    def __init__(self, delta: SketchDelta, ws: list[torch.Tensor], prepared: PreparedCommit, static, V32, noises,
                 dense: list[tuple[torch.Tensor, torch.Tensor]], cache: Optional[ProjectionCache],
                 ticket: Optional[int]) -> None:
        self.delta = delta
        self._ws, self._prepared, self._static = ws, prepared, static
        self._V32, self._noises, self._dense = V32, noises, dense
        self._cache, self._ticket = cache, ticket
        self._committed = False

    @property
    def num_tensors(self) -> int:
        """Engine tensors the commit writes: factor merges and dense copies."""
        return len(self._ws) + len(self._dense)

    @torch.no_grad()
    @ieee_fp32()
    def commit_(self) -> int:
        """Write the staged delta into the weights; returns ``delta.new_version``.

        Raises ``SyncError("apply")`` without writing when this stage was committed already or the cache
        staged another delta since; a failure during the writes (a kernel error, no allocation happens
        here) raises ``SyncError("apply")`` saying the weights are partially written.
        """
        delta = self.delta
        if self._committed:
            raise SyncError("apply", f"delta {delta.base_version}->{delta.new_version} was already committed")
        if self._cache is not None and not self._cache.is_current_stage(self._ticket):
            raise SyncError("apply", f"delta {delta.base_version}->{delta.new_version} is stale: another delta was "
                                     "staged through the same ProjectionCache since; stage it again")
        self._committed = True
        done = 0
        try:
            if self._static is not None:
                self._static.commit_(self._ws, delta.decay == 1.0)
                done += len(self._ws)
            else:
                for m, (w, V32_OR, noise) in enumerate(zip(self._ws, self._V32, self._noises)):
                    self._prepared.merge_(m, w, V32_OR, noise, delta.decay)
                    done += 1
            for dst, src in self._dense:
                dst.copy_(src)
                done += 1
        except Exception as exc:  # pragma: no cover - needs a failing in-place kernel
            logger.critical("delta %d->%d partially applied (%d of %d tensors): reload a full anchor",
                            delta.base_version, delta.new_version, done, self.num_tensors)
            raise SyncError("apply", f"commit failed after {done} tensors; weights are partially written, "
                                     "reload a full refit") from exc
        logger.debug("applied delta %d->%d: %d factors, %d dense", delta.base_version, delta.new_version,
                     len(self._ws), len(self._dense))
        return delta.new_version
