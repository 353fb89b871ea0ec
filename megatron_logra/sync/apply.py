"""The all-or-nothing apply of a sketch delta to an engine's weights (the merge itself: :mod:`megatron_logra.sync.merge`).

``apply_delta_`` validates the whole delta first (versions, names, shapes, dtypes,
finiteness, factors on the exact-sum grid), then prepares every projection, scaled factor ``V``
and dense cast (all allocations), and only then commits with in-place kernels into preallocated
workspaces. Any failure before the commit leaves the weights untouched; the commit itself
allocates nothing. Validation reads each factor once (finite: any finite ``U`` merges exactly,
since ``V = grid(s·U)`` is rounded onto its grid on both sides); each layer's
``A`` is regenerated once per apply and shared by the engine parameters cut from it (``q``/``k``/``v``,
``gate``/``up``), and turned into ``sign(A)`` by bit operations; an engine that passes a
:class:`ProjectionCache` regenerates it only when the projection changes (a new seed, update index
or rank), not every sync, and keeps the structure-only part of the apply (which rows of which ``U``
each engine weight takes, kernel choices, workspaces: :mod:`megatron_logra.sync.prepared`) while
the delta's structure and the engine's weights stay the same: such an apply checks the header, the
version chain, the dense entries and the factors' finiteness (the per-weight names, shapes and dtypes
passed for that structure and those very weights). What remains is the arithmetic itself: per target
weight a rank-r GEMM (``2r`` flops) and one read-modify-write pass.

This module keeps the layout-dependent validation (:func:`validate`) and the staging
(:func:`stage_delta`, :func:`apply_delta_`); the structure-free checks (version chain, dense
entries, finiteness) are :mod:`megatron_logra.sync.delta_checks`, the staged commit
(:class:`StagedDelta`) is :mod:`megatron_logra.sync.staged_delta`; both are re-exported here, as are
the merge's and the factors' names listed in ``__all__``.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.delta_checks import (  # noqa: F401  (check_version: re-exported)
    _check_dense,
    _first_nonfinite,
    _require,
    check_version,
)
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import off_grid_rows, quantize_factor, rademacher_scale
from megatron_logra.sync.layout import EnginePlan, dense_for, plan_for
from megatron_logra.sync.merge import (
    MERGE_DTYPES,
    StochasticRounding,
    chunk_elems,
    low_rank_merge_,
    merge_row_chunks,
    noise_parts,
    shard_rows,
)
from megatron_logra.sync.precision import ieee_fp32
from megatron_logra.sync.prepared import prepare, structure_key
from megatron_logra.sync.prepared_commit import PreparedCommit
from megatron_logra.sync.projection_cache import ProjectionCache
from megatron_logra.sync.staged_delta import StagedDelta

__all__ = [
    "low_rank_merge_", "merge_row_chunks", "quantize_factor", "off_grid_rows", "rademacher_scale",
    "validate", "apply_delta_", "check_version", "chunk_elems", "MERGE_DTYPES", "StochasticRounding",
    "shard_rows", "ProjectionCache", "noise_parts", "stage_delta", "StagedDelta",
]


def validate(
    delta: SketchDelta,
    weights: dict[str, torch.Tensor],
    current_version: int,
    *,
    layout: str = "hf",
    tp_size: int = 1,
    tp_rank: int = 0,
) -> EnginePlan:
    """Check ``delta`` against ``weights`` (engine names, this rank's shards) without touching anything.

    Checks the message structure, the version chain, that every engine parameter it maps to
    exists with the right shape and a supported dtype, that dense shapes match (the whole tensor,
    0-d included; a vocab-parallel entry: this rank's row block), and that every U and dense
    tensor is finite: everything the commit relies on, so a delta it could not finish is
    rejected before the first write. Returns the engine plan; raises :class:`SyncError` naming
    the first problem.
    """
    delta.check_structure()
    check_version(delta, current_version)
    plan = _validate_layout(delta, weights, layout, tp_size, tp_rank)
    bad = _first_nonfinite([t.U_OR for t in delta.targets])  # any finite U merges exactly: V = grid(s·U)
    if bad is not None:
        raise SyncError("nonfinite", f"U of {delta.targets[bad].name} has non-finite entries")
    return plan


def _validate_layout(delta: SketchDelta, weights: dict[str, torch.Tensor], layout: str,
                     tp_size: int, tp_rank: int) -> EnginePlan:
    """Everything :func:`validate` checks but the message structure, the version chain (its callers check
    those first) and the finiteness of the factors (which :func:`apply_delta_` reads off the row maxima it
    computes for ``V`` anyway)."""
    try:
        plan = plan_for(delta, layout, tp_size, tp_rank)
    except SyncError:
        raise
    except Exception as exc:  # a layout the engine cannot map is a rejection like any other
        raise SyncError("layout", f"mapping delta {delta.base_version}->{delta.new_version} onto the {layout} "
                                  f"layout (TP {tp_rank} of {tp_size}) failed: {exc!r}") from exc
    _require(sorted({f.param for f in plan.factors} | {d.param for d in plan.dense}), weights)
    for f in plan.factors:
        w = weights[f.param]
        n_in_local = len(f.cols) if f.cols is not None else f.n_in
        want = (f.U_OR.shape[0], n_in_local)
        if w.dim() != 2 or tuple(w.shape) != want:
            raise SyncError("shape", f"{f.param}: engine weight {tuple(w.shape)}, delta implies {want}")
        if w.dtype not in MERGE_DTYPES:
            raise SyncError("dtype", f"{f.param}: engine weight dtype {w.dtype} is not one of {MERGE_DTYPES}")
    _check_dense(plan.dense, [f.param for f in plan.factors], weights, tp_size)
    return plan


@torch.no_grad()
@ieee_fp32()
def stage_delta(
    weights: dict[str, torch.Tensor],
    delta: SketchDelta,
    current_version: int,
    *,
    layout: str = "hf",
    tp_size: int = 1,
    tp_rank: int = 0,
    max_chunk_elems: Optional[int] = None,
    cache: Optional[ProjectionCache] = None,
) -> StagedDelta:
    """Validate ``delta`` against ``weights`` and prepare its commit; writes no weight.

    Everything :func:`apply_delta_` does before its first write: the checks of :func:`validate`
    and every allocation (projections, scaled factors ``V``, rounding noise, dense casts,
    workspaces, the fused-kernel checks). Raises :class:`SyncError` naming the first problem; any
    other failure here (an allocation) is raised as ``SyncError("apply")``, the weights untouched.
    ``cache``: the engine's :class:`ProjectionCache` (None: regenerate ``sign(A)`` and prepare the
    commit for this delta only). With a cache, a delta of the structure the cache last prepared,
    on the same weights, skips the per-weight planning and checks (they passed for that structure
    and those very weights) and checks the header, the version chain, the dense entries and the
    factors' finiteness.
    """
    # the ticket first: from here on this stage may refill the cache's fixed-address inputs, so an earlier stage
    # stops being committable even when this one fails
    ticket = cache.next_stage() if cache is not None else None
    key = structure_key(delta, layout, tp_size, tp_rank, max_chunk_elems)
    delta.check_structure()
    check_version(delta, current_version)
    kept = cache.prepared(key, weights) if cache is not None else None
    try:
        if kept is None:
            plan = _validate_layout(delta, weights, layout, tp_size, tp_rank)
            prepared: PreparedCommit = prepare(delta, plan.factors, weights, key, cache=cache,
                                               max_chunk_elems=max_chunk_elems)
            if cache is not None:
                cache.keep(prepared)
            ws = [weights[p] for p in prepared.params]
            dense_plan = plan.dense
        else:
            prepared, ws = kept
            dense_plan = dense_for(delta, layout, tp_size, tp_rank)
            _check_dense(dense_plan, prepared.params, weights, tp_size)
        static = cache.static_for(prepared, ws) if cache is not None and cache.cuda_graphs else None
        V32 = noises = None
        if static is not None:
            static.stage(delta, ws)  # the inputs at fixed addresses (and the graph's capture): no weight written
        else:
            V32 = prepared.factors(delta)
            noises = prepared.noises(delta)
        dense = []
        for d in dense_plan:
            w = weights[d.param]
            src, dst = d.tensor, w
            if d.split == "vocab":  # this rank's row block; padding rows past the vocabulary stay untouched
                lo = tp_rank * w.shape[0]
                src = src[lo : min(lo + w.shape[0], src.shape[0])]
                dst = w[: src.shape[0]]
            if dst.shape != src.shape:  # the commit copies exactly src into dst: nothing else may be left to it
                raise SyncError("shape", f"dense {d.param}: engine slice {tuple(dst.shape)} vs delta slice "
                                         f"{tuple(src.shape)} (split={d.split})")
            dense.append((dst, src.to(device=w.device, dtype=w.dtype).contiguous()))
    except SyncError:
        raise
    except Exception as exc:  # nothing written yet
        raise SyncError("apply", f"preparing delta {delta.base_version}->{delta.new_version} failed before any write: {exc!r}") from exc
    return StagedDelta(delta, ws, prepared, static, V32, noises, dense, cache, ticket)


def apply_delta_(
    weights: dict[str, torch.Tensor],
    delta: SketchDelta,
    current_version: int,
    *,
    layout: str = "hf",
    tp_size: int = 1,
    tp_rank: int = 0,
    max_chunk_elems: Optional[int] = None,
    cache: Optional[ProjectionCache] = None,
) -> int:
    """Apply ``delta`` to ``weights`` in place and return ``delta.new_version``: :func:`stage_delta`, then
    :meth:`StagedDelta.commit_`.

    ``weights`` maps engine parameter names (``layout``, this rank's shards) to tensors.
    All-or-nothing: validation and every allocation happen before the first weight is written; the
    commit then runs only in-place kernels into preallocated buffers. A failure during the commit
    (which would take a kernel error, not an allocation) raises ``SyncError("apply")`` saying the
    weights are partially written and need a full refit. ``cache``: as for :func:`stage_delta`.
    """
    return stage_delta(weights, delta, current_version, layout=layout, tp_size=tp_size, tp_rank=tp_rank,
                       max_chunk_elems=max_chunk_elems, cache=cache).commit_()
