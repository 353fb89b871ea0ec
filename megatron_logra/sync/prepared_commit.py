"""The prepared commit: what applying deltas of one structure to one set of engine weights needs besides the
delta's values, and the commit steps that run on it every sync.

A :class:`PreparedCommit` (built by :func:`megatron_logra.sync.prepared.prepare`) holds per engine weight its
``sign(A)`` (or Gaussian ``A``), the kernel choice and the row-chunk size, per device the gather of the
targets' ``U`` rows and the rounding-noise coordinates, and the merge workspaces. Its methods are the per-sync
work on a delta: ``V`` for each device group in one pass, the noise hashes in one pass, and each weight's merge
into the preallocated workspaces (no allocation). Imports only torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megatron_logra.sketch.random_projection import entry_hash_parts_many
from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import scaled_factor_rows
from megatron_logra.sync.merge import ROUNDING_LANE, _merge_prepared_, _Noise, rounding_key

__all__ = ["PreparedCommit", "PreparedMerge", "DeviceGroup", "weight_signature"]


def weight_signature(ws: list[torch.Tensor]) -> tuple:
    """Storage, shape, stride, dtype and device of each of ``ws``: a prepared commit is reused only for
    weights with the very same signature (a reallocated or reshaped weight is prepared again)."""
    return tuple((w.data_ptr(), w.shape, w.stride(), w.dtype, w.device) for w in ws)



@dataclass
class PreparedMerge:
    """One engine weight's merge: its ``sign(A)`` (or Gaussian ``A``) and kernel choice."""

    matrix: torch.Tensor
    fused: bool
    elems: int
    noisy: bool


@dataclass
class DeviceGroup:
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
    merges: list[PreparedMerge]
    groups: list[DeviceGroup]
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
        return ws if weight_signature(ws) == self.signature else None

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
        :attr:`DeviceGroup.noise_merges` order), or None where it has none: one hash pass per group."""
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
