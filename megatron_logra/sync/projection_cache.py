"""The projection cache an engine keeps across syncs, and the projection matrices of an apply.

Without ``logra.refresh`` every update of a run is projected by the same ``A``: :class:`ProjectionCache` keeps
its ``sign(A)`` (regenerated only for a new seed, update index or rank) and the latest
:class:`~megatron_logra.sync.prepared_commit.PreparedCommit`, so a steady run pays neither the regeneration nor
the preparation per sync. :func:`projection_matrices` is what each engine factor's GEMM multiplies, taken from
the cache or regenerated. Imports only torch.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_logra.sketch.naming import canonical_name
from megatron_logra.sketch.random_projection import projection, rademacher_projections, shared_projections
from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.factors import rademacher_scale, rademacher_signs, split_projection
from megatron_logra.sync.layout import EngineFactor
from megatron_logra.sync.prepared_commit import PreparedCommit

__all__ = ["ProjectionCache", "projection_matrices", "CUDA_GRAPH_ENV"]

CUDA_GRAPH_ENV = "MEGATRON_LOGRA_APPLY_CUDA_GRAPH"
"""Environment switch of :class:`ProjectionCache`'s ``cuda_graphs`` default: ``1`` replays the commit as a
CUDA graph (:mod:`megatron_logra.sync.graph`)."""




class ProjectionCache:
    """What an engine keeps across syncs: the ``sign(A)`` of the latest projection and the latest
    :class:`PreparedCommit`.

    Without ``logra.refresh`` every update of a run is projected by the same ``A`` (same seed, update
    index 0), so an engine that keeps one of these (and passes it to
    :func:`megatron_logra.sync.apply.apply_delta_`) regenerates ``A`` once per projection instead of once
    per sync, and prepares the commit once per delta structure. It holds one projection at a time: a
    delta with another seed, update index or rank replaces the contents. The cost is ``r`` fp32 rows per
    layer input width (``r/n_out`` of the target weights) and the merge workspaces (one row chunk each:
    :func:`megatron_logra.sync.merge.chunk_elems`), on the weights' devices. One apply at a time per cache:
    the workspaces are shared, and a staged delta (:func:`megatron_logra.sync.apply.stage_delta`) can only be
    committed while it is the latest one staged through the cache (:meth:`next_stage`).

    ``cuda_graphs``: commit through a :class:`megatron_logra.sync.graph.StaticCommit` (the inputs at fixed
    addresses, ``V`` and the noise once more in memory), replayed as one CUDA graph per sync where the
    weights sit on one GPU; eagerly elsewhere. None: the environment switch :data:`CUDA_GRAPH_ENV`
    (``1`` turns it on; off by default), which reaches engines built inside an inference server.
    """

    def __init__(self, cuda_graphs: Optional[bool] = None) -> None:
        if cuda_graphs is None:
            cuda_graphs = os.environ.get(CUDA_GRAPH_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
        self.cuda_graphs = cuda_graphs
        self._key: Optional[tuple[int, int, int]] = None
        self._signs: dict[tuple, torch.Tensor] = {}
        self._prepared: Optional[PreparedCommit] = None
        self._static = None
        self._stage = 0

    def next_stage(self) -> int:
        """A ticket for a newly staged delta; every earlier ticket stops being current."""
        self._stage += 1
        return self._stage

    def is_current_stage(self, ticket: int) -> bool:
        """True iff ``ticket`` is the latest :meth:`next_stage` handed out."""
        return ticket == self._stage

    def signs(self, delta: SketchDelta, device: torch.device, n_in: int, cols: Optional[tuple[int, int]],
              names: tuple[str, ...]) -> torch.Tensor:
        """``sign(A)`` ``[len(names), r, n_in_local]`` of ``names`` (canonical) at ``cols``; built if missing."""
        key = (delta.seed, delta.update_index, delta.rank)
        if key != self._key:
            self._key, self._signs, self._prepared, self._static = key, {}, None, None
        slot = (device, n_in, cols, names)
        out = self._signs.get(slot)
        if out is None:
            out = _signs(delta, device, n_in, cols, names)
            self._signs[slot] = out
        return out

    def prepared(self, key: tuple, weights: dict[str, torch.Tensor]
                 ) -> Optional[tuple[PreparedCommit, list[torch.Tensor]]]:
        """The kept commit and its weights when it was prepared for ``key`` and these very weights, else None."""
        p = self._prepared
        if p is None or p.key != key:
            return None
        ws = p.weights(weights)
        return None if ws is None else (p, ws)

    def keep(self, prepared: PreparedCommit) -> None:
        """Keep ``prepared`` for the next syncs (replacing the previous one, and its static commit)."""
        self._prepared, self._static = prepared, None

    def static_for(self, prepared: PreparedCommit, weights: list[torch.Tensor]):
        """The :class:`megatron_logra.sync.graph.StaticCommit` of the kept ``prepared`` (made on first use)."""
        from megatron_logra.sync.graph import StaticCommit  # it builds on this module

        assert prepared is self._prepared, "a static commit belongs to the kept prepared commit"
        if self._static is None or self._static.prepared is not prepared:
            self._static = StaticCommit(prepared, weights)
        return self._static

    def __len__(self) -> int:
        return len(self._signs)


def _signs(delta: SketchDelta, device: torch.device, n_in: int, cols: Optional[tuple[int, int]],
           names: tuple[str, ...]) -> torch.Tensor:
    A_PRI = rademacher_projections(delta.seed, list(names), delta.update_index, delta.rank, n_in,
                                   cols=None if cols is None else range(*cols), device=device)
    return rademacher_signs(A_PRI)[0]  # regenerated here: ±s by construction


def projection_matrices(delta: SketchDelta, factors: list[EngineFactor], weights: dict[str, torch.Tensor],
                        cache: Optional[ProjectionCache] = None) -> tuple[list[torch.Tensor], Optional[float]]:
    """The matrix each factor's GEMM multiplies and the scale folded into ``V``: ``sign(A[:, cols])`` and
    ``s`` (Rademacher: every layer of one width and column range regenerated in one batch, or taken
    from ``cache``), or ``A`` itself and None (Gaussian)."""
    if delta.distribution != "rademacher":
        out = []
        with shared_projections():  # q/k/v (gate/up) of one layer share A: computed once per apply
            for f in factors:
                A_RI = projection(delta.seed, f.target, delta.update_index, delta.rank, f.n_in,
                                  distribution=delta.distribution, cols=f.cols, device=weights[f.param].device)
                out.append(split_projection(A_RI, delta.distribution)[0])
        return out, None
    groups: dict[tuple, dict[str, int]] = {}  # (device, n_in, cols) -> canonical target -> slot
    where = []
    for f in factors:
        cols = None if f.cols is None else (f.cols.start, f.cols.stop)
        names = groups.setdefault((weights[f.param].device, f.n_in, cols), {})
        where.append(names.setdefault(canonical_name(f.target), len(names)))
    signs = {}
    for (device, n_in, cols), names in groups.items():
        key = tuple(names)
        signs[(device, n_in, cols)] = (cache.signs(delta, device, n_in, cols, key) if cache is not None
                                       else _signs(delta, device, n_in, cols, key))
    out = []
    for f, slot in zip(factors, where):
        cols = None if f.cols is None else (f.cols.start, f.cols.stop)
        out.append(signs[(weights[f.param].device, f.n_in, cols)][slot])
    return out, rademacher_scale(delta.rank)
