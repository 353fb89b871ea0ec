"""What an engine prepares once per delta structure, and the cache that keeps it across syncs.

An apply's work splits in two. Some depends on the delta's values: the factors ``U`` (hence ``V``), the
optimizer step that keys the rounding noise, the decay. The rest depends only on the delta's structure
and the engine's weights: which engine parameters it touches and which rows of each target's ``U`` each
takes, their ``sign(A)``, whether the fused kernel may run on each weight, the merge workspaces.
:func:`prepare` builds the second kind from a validated plan as a :class:`PreparedCommit`; an engine's
:class:`ProjectionCache` keeps the latest one and hands it back while the structure key and the
engine's weights (storage, shape, stride, dtype, device) are unchanged. Without ``logra.refresh`` every
sync of a run after the first hits: the apply then costs the header checks, one ``V`` computation and
one noise computation per device, and the merge kernels -- a few dozen host operations plus the kernels
of each weight, where building the plan costs several per weight.
:func:`prepare` is the planning and workspace allocation; the commit steps that run every sync are
:class:`~megatron_logra.sync.prepared_commit.PreparedCommit`'s and the cache is
:class:`~megatron_logra.sync.projection_cache.ProjectionCache`. Imports only torch.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.fused import fused_enabled
from megatron_logra.sync.layout import EngineFactor
from megatron_logra.sync.merge import _fused, _workspaces_elems, chunk_elems
from megatron_logra.sync.prepared_commit import DeviceGroup, PreparedCommit, PreparedMerge, weight_signature
from megatron_logra.sync.projection_cache import ProjectionCache, projection_matrices

__all__ = ["prepare", "structure_key"]


def structure_key(delta: SketchDelta, layout: str, tp_size: int, tp_rank: int, max_chunk_elems: Optional[int]
                  ) -> tuple:
    """Everything a :class:`PreparedCommit` depends on besides the engine's weights: the projection (seed,
    update index, rank, distribution), the rounding, the targets' names, shapes and layouts, the engine
    layout and TP position, and what decides the kernels (chunk size, thread count, the fused switch)."""
    return (layout, tp_size, tp_rank, delta.seed, delta.update_index, delta.rank, delta.distribution, delta.rounding,
            delta.attention, tuple((t.name, t.U_OR.shape[0], t.n_in, t.layout) for t in delta.targets),
            max_chunk_elems, torch.get_num_threads(), fused_enabled())

def prepare(delta: SketchDelta, factors: list[EngineFactor], weights: dict[str, torch.Tensor], key: tuple, *,
            cache: Optional[ProjectionCache] = None, max_chunk_elems: Optional[int] = None) -> PreparedCommit:
    """The :class:`PreparedCommit` of the validated engine ``factors`` (:func:`megatron_logra.sync.layout.plan_for`)
    of ``delta`` on ``weights``: projections, kernel choices (the fused-kernel checks run here, before any
    write), workspaces, and per device the rows of the targets' ``U`` each factor takes and its noise
    coordinates. Allocates; writes no weight."""
    matrices, scale = projection_matrices(delta, factors, weights, cache)
    index = {t.name: i for i, t in enumerate(delta.targets)}
    stochastic = delta.rounding == "stochastic"
    merges, target_of = [], []
    by_device: dict[torch.device, list[int]] = {}
    need: dict[torch.device, list[int]] = {}
    for m, (f, matrix) in enumerate(zip(factors, matrices)):
        w = weights[f.param]
        elems = chunk_elems(w.device, max_chunk_elems)
        fused = _fused(w, delta.rank, delta.distribution, elems)
        noisy = stochastic and w.dtype == torch.bfloat16
        merges.append(PreparedMerge(matrix, fused, elems, noisy))
        target_of.append(index[f.target])
        by_device.setdefault(w.device, []).append(m)
        cur = need.setdefault(w.device, [0, 0, 0])
        for j, n in enumerate(_workspaces_elems(w, fused, noisy, elems)):
            cur[j] = max(cur[j], n)
    groups = [_group(device, ms, factors, target_of, delta, merges, weights) for device, ms in by_device.items()]
    workspaces = {dev: (torch.empty(a, dtype=torch.float32, device=dev), torch.empty(b, dtype=torch.float32, device=dev),
                        torch.empty(c, dtype=torch.int32, device=dev)) for dev, (a, b, c) in need.items()}
    params = [f.param for f in factors]
    return PreparedCommit(key=key, params=params, signature=weight_signature([weights[p] for p in params]),
                          merges=merges, groups=groups, scale=scale, workspaces=workspaces, target_of=target_of)


def _group(device: torch.device, ms: list[int], factors: list[EngineFactor], target_of: list[int],
           delta: SketchDelta, merges: list[PreparedMerge], weights: dict[str, torch.Tensor]) -> DeviceGroup:
    """The gather of one device's factors out of their targets' ``U`` and their noise coordinates."""
    order: dict[int, int] = {}  # target index -> first row in the concatenation
    offset = 0
    for m in ms:
        if target_of[m] not in order:
            order[target_of[m]] = offset
            offset += delta.targets[target_of[m]].U_OR.shape[0]
    rows = []
    for m in ms:
        f, t = factors[m], delta.targets[target_of[m]]
        own = torch.arange(t.U_OR.shape[0]) if f.rows is None else f.rows.to(torch.int64)
        assert own.numel() == f.U_OR.shape[0], f"{f.param}: {own.numel()} rows for a factor of {f.U_OR.shape[0]}"
        rows.append(own + order[target_of[m]])
    gather = torch.cat(rows)
    identity = gather.numel() == offset and bool(torch.equal(gather, torch.arange(offset)))
    g = DeviceGroup(device=device, targets=list(order), gather=None if identity else gather, merges=ms,
               sizes=[factors[m].U_OR.shape[0] for m in ms])
    for m in ms:
        if merges[m].noisy:
            f = factors[m]
            n_out, n_in = weights[f.param].shape
            g.noise_merges.append(m)
            g.noise_targets.append(f.target)
            g.noise_rows.append((torch.arange(n_out) if f.rows is None else f.rows).to(device))
            start = f.cols.start if f.cols is not None else 0
            g.noise_cols.append(torch.arange(start, start + n_in, device=device))
    return g
