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
of each weight, where building the plan costs several per weight. Imports only torch.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megatron_logra.sketch.naming import canonical_name
from megatron_logra.sketch.random_projection import (
    entry_hash_parts_many,
    projection,
    rademacher_projections,
    shared_projections,
)
from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import rademacher_scale, rademacher_signs, scaled_factor_rows, split_projection
from megatron_logra.sync.fused import fused_enabled
from megatron_logra.sync.layout import EngineFactor
from megatron_logra.sync.merge import (
    ROUNDING_LANE,
    _fused,
    _merge_prepared_,
    _Noise,
    _workspaces_elems,
    chunk_elems,
    rounding_key,
)

__all__ = ["ProjectionCache", "PreparedCommit", "prepare", "structure_key", "CUDA_GRAPH_ENV"]

CUDA_GRAPH_ENV = "MEGATRON_LOGRA_APPLY_CUDA_GRAPH"
"""Environment switch of :class:`ProjectionCache`'s ``cuda_graphs`` default: ``1`` replays the commit as a
CUDA graph (:mod:`megatron_logra.sync.graph`)."""


def structure_key(delta: SketchDelta, layout: str, tp_size: int, tp_rank: int, max_chunk_elems: Optional[int]
                  ) -> tuple:
    """Everything a :class:`PreparedCommit` depends on besides the engine's weights: the projection (seed,
    update index, rank, distribution), the rounding, the targets' names, shapes and layouts, the engine
    layout and TP position, and what decides the kernels (chunk size, thread count, the fused switch)."""
    return (layout, tp_size, tp_rank, delta.seed, delta.update_index, delta.rank, delta.distribution, delta.rounding,
            delta.attention, tuple((t.name, t.U_OR.shape[0], t.n_in, t.layout) for t in delta.targets),
            max_chunk_elems, torch.get_num_threads(), fused_enabled())


def _weight_signature(ws: list[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), w.shape, w.stride(), w.dtype, w.device) for w in ws)


@dataclass
class _Merge:
    """One engine weight's merge: its ``sign(A)`` (or Gaussian ``A``) and kernel choice."""

    matrix: torch.Tensor
    fused: bool
    elems: int
    noisy: bool


@dataclass
class _Group:
    """The factors of one device: ``V`` is computed for all of them at once from the targets' ``U``."""

    device: torch.device
    targets: list[int]
    """Indices into ``delta.targets`` whose ``U`` are concatenated, in this order."""
    gather: Optional[torch.Tensor]
    """int64 rows of that concatenation, in the merges' order (None: the concatenation itself)."""
    merges: list[int]
    sizes: list[int]
    """Rows of ``V`` per merge of :attr:`merges`."""
    noise_merges: list[int] = field(default_factory=list)
    noise_targets: list[str] = field(default_factory=list)
    noise_rows: list[torch.Tensor] = field(default_factory=list)
    noise_cols: list[torch.Tensor] = field(default_factory=list)


@dataclass
class PreparedCommit:
    """The structure-only part of applying deltas of one structure to one set of engine weights."""

    key: tuple
    params: list[str]
    """Engine parameter of each merge, in plan order."""
    signature: tuple
    """Storage, shape, stride, dtype and device of each of those weights when prepared."""
    merges: list[_Merge]
    groups: list[_Group]
    scale: Optional[float]
    """The Rademacher scale folded into ``V`` (None: Gaussian, ``V = U``)."""
    workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """Per device: (product, fp32 scratch, int32 noise) buffers, each as large as the largest merge needs."""
    target_of: list[int]
    """Index into ``delta.targets`` of each merge's target."""

    def weights(self, weights: dict[str, torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """This commit's weights out of ``weights``, or None where any is missing or not the one prepared for."""
        try:
            ws = [weights[p] for p in self.params]
        except KeyError:
            return None
        return ws if _weight_signature(ws) == self.signature else None

    def group_factors(self, delta: SketchDelta) -> list[torch.Tensor]:
        """``V = grid(s·U)`` ``[rows, r]`` of each device group's merges, in their order, computed in one pass
        over the gathered rows (rows are independent, so gathering before or after gives the same bits).
        Raises ``SyncError("nonfinite")`` naming the first target with a NaN or inf among them."""
        out = []
        for g in self.groups:
            parts = [delta.targets[i].U_OR for i in g.targets]
            U = torch.cat(parts) if len(parts) > 1 else parts[0]
            if g.gather is not None:
                U = U.index_select(0, g.gather if U.device == g.gather.device else g.gather.to(U.device))
            V, bad_O = scaled_factor_rows(U.to(device=g.device), self.scale)
            if bool(bad_O.any()):
                first = int(bad_O.nonzero()[0, 0])
                m = next(m for m, end in zip(g.merges, itertools.accumulate(g.sizes)) if first < end)
                raise SyncError("nonfinite", f"U of {delta.targets[self.target_of[m]].name} has non-finite entries")
            out.append(V)
        return out

    def factors(self, delta: SketchDelta) -> list[torch.Tensor]:
        """:meth:`group_factors` split per merge (in merge order)."""
        out: list[Optional[torch.Tensor]] = [None] * len(self.merges)
        for g, V in zip(self.groups, self.group_factors(delta)):
            for m, v in zip(g.merges, V.split(g.sizes)):
                out[m] = v
        return out  # type: ignore[return-value]

    def group_noises(self, delta: SketchDelta) -> list[Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]]:
        """Per device group, the row and column noise hashes of its noisy merges for ``delta.step`` (in
        :attr:`_Group.noise_merges` order), or None where it has none: one hash pass per group."""
        out: list[Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]] = []
        for g in self.groups:
            if not g.noise_merges:
                out.append(None)
                continue
            keys = [rounding_key(delta.seed, t, delta.step) for t in g.noise_targets]
            out.append(entry_hash_parts_many(keys, g.noise_rows, g.noise_cols, ROUNDING_LANE, low_bits=16))
        return out

    def noises(self, delta: SketchDelta) -> list[Optional[_Noise]]:
        """Each merge's rounding noise for ``delta.step`` (None: rounded to nearest)."""
        out: list[Optional[_Noise]] = [None] * len(self.merges)
        for g, parts in zip(self.groups, self.group_noises(delta)):
            if parts is not None:
                for m, rb, cb in zip(g.noise_merges, *parts):
                    out[m] = (rb, cb)
        return out

    def merge_(self, m: int, weight: torch.Tensor, V32_OR: torch.Tensor, noise: Optional[_Noise],
               decay: Union[float, torch.Tensor]) -> None:
        """Run merge ``m`` (merge order) into ``weight`` in place: its matrix and kernel choice, the workspaces
        of the weight's device (:func:`megatron_logra.sync.merge._merge_prepared_`; no allocation)."""
        merge = self.merges[m]
        prod_buf, tmp_buf, noise_buf = self.workspaces[weight.device]
        _merge_prepared_(weight, V32_OR, merge.matrix, decay, prod_buf, tmp_buf, merge.elems, noise, noise_buf,
                         merge.fused)


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
        merges.append(_Merge(matrix, fused, elems, noisy))
        target_of.append(index[f.target])
        by_device.setdefault(w.device, []).append(m)
        cur = need.setdefault(w.device, [0, 0, 0])
        for j, n in enumerate(_workspaces_elems(w, fused, noisy, elems)):
            cur[j] = max(cur[j], n)
    groups = [_group(device, ms, factors, target_of, delta, merges, weights) for device, ms in by_device.items()]
    workspaces = {dev: (torch.empty(a, dtype=torch.float32, device=dev), torch.empty(b, dtype=torch.float32, device=dev),
                        torch.empty(c, dtype=torch.int32, device=dev)) for dev, (a, b, c) in need.items()}
    params = [f.param for f in factors]
    return PreparedCommit(key=key, params=params, signature=_weight_signature([weights[p] for p in params]),
                          merges=merges, groups=groups, scale=scale, workspaces=workspaces, target_of=target_of)


def _group(device: torch.device, ms: list[int], factors: list[EngineFactor], target_of: list[int],
           delta: SketchDelta, merges: list[_Merge], weights: dict[str, torch.Tensor]) -> _Group:
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
    g = _Group(device=device, targets=list(order), gather=None if identity else gather, merges=ms,
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
