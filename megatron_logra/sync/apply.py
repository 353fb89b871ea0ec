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
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import off_grid_rows, quantize_factor, rademacher_scale
from megatron_logra.sync.layout import DenseEntry, EnginePlan, dense_for, plan_for
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

logger = logging.getLogger(__name__)

__all__ = [
    "low_rank_merge_", "merge_row_chunks", "quantize_factor", "off_grid_rows", "rademacher_scale",
    "validate", "apply_delta_", "check_version", "chunk_elems", "MERGE_DTYPES", "StochasticRounding",
    "shard_rows", "ProjectionCache", "noise_parts", "stage_delta", "StagedDelta",
]

def check_version(delta: SketchDelta, current_version: int) -> None:
    """Raise :class:`SyncError` unless ``delta.base_version == current_version``.

    ``new_version <= current``: replay (``replay``); ``base > current``: missing deltas
    (``gap``); otherwise the base diverged from the engine (``version``).
    """
    if delta.base_version == current_version:
        return
    if delta.new_version <= current_version:
        raise SyncError("replay", f"delta {delta.base_version}->{delta.new_version} is already applied (engine at {current_version})")
    if delta.base_version > current_version:
        raise SyncError("gap", f"delta {delta.base_version}->{delta.new_version} skips versions: engine is at {current_version}")
    raise SyncError("version", f"delta base {delta.base_version} != engine version {current_version}")


def _first_nonfinite(tensors: list[torch.Tensor]) -> Optional[int]:
    """Index of the first tensor holding a NaN or inf, or None: min/max of each (NaN propagates), read
    back once per device rather than once per tensor."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append(i)
    bad = []
    for idx in by_device.values():
        ends = torch.stack([torch.stack(torch.aminmax(tensors[i])).float() for i in idx])
        finite = torch.isfinite(ends).all(dim=1).tolist()
        bad += [i for i, ok in zip(idx, finite) if not ok]
    return min(bad) if bad else None


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``: one min/max pass (NaN propagates through both; a third of ``isfinite``'s work)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


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


def _require(params: list[str], weights: dict[str, torch.Tensor]) -> None:
    """Raise ``SyncError("name")`` naming the first few of ``params`` the engine does not have."""
    missing = [p for p in params if p not in weights]
    if missing:
        raise SyncError("name", f"engine has no parameters {missing[:6]}{'...' if len(missing) > 6 else ''}")


def _check_dense(dense: list[DenseEntry], factor_params: list[str], weights: dict[str, torch.Tensor],
                 tp_size: int) -> None:
    """The dense entries' checks of :func:`validate` (and that no two entries share an engine parameter)."""
    _require(sorted({d.param for d in dense}), weights)
    for d in dense:
        w = weights[d.param]
        if d.split == "vocab":  # row blocks: both sides need a row dimension
            ok = w.dim() >= 1 and d.tensor.dim() == w.dim()
            if ok:
                rows = w.shape[0] * tp_size
                ok = tuple(w.shape[1:]) == tuple(d.tensor.shape[1:]) and rows >= d.tensor.shape[0] > rows - w.shape[0]
        else:  # the whole tensor (any rank, 0-d included)
            ok = tuple(w.shape) == tuple(d.tensor.shape)
        if not ok:
            raise SyncError("shape", f"dense {d.param}: engine {tuple(w.shape)} vs delta {tuple(d.tensor.shape)} (split={d.split})")
        if not _finite(d.tensor):
            raise SyncError("nonfinite", f"dense {d.param} has non-finite entries")
    params = factor_params + [d.param for d in dense]
    if len(set(params)) != len(params):
        raise SyncError("name", "delta maps two entries onto one engine parameter")


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
