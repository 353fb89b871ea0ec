"""Global figures of a LoGRA update from per-rank partial sums: update and drift norms over the targets.

Each rank holds its shards of the targets (column-parallel rows split over TP; row-parallel and
unsharded sketches as full rows) and its pipeline stage's layers; a norm is the sum over the
model-parallel group, counting a TP-replicated target once (on TP rank 0). Every method is collective
over that group and gives every rank of it the same figure.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from megatron_logra.optim.functional import reconstructed_norm2
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.parallel import all_reduce_sum, group_size
from megatron_logra.sketch.targets import SketchTarget

__all__ = ["LograNormsMixin"]


class LograNormsMixin:
    """Model-parallel sums and update norms of :class:`~megatron_logra.optim.logra.LograOptimizer`; needs
    ``groups``, ``device``, ``targets``, ``sketches`` and ``masters`` on the optimizer."""

    def _replicated_on_tp(self, t: SketchTarget) -> bool:
        return t.parallel == "none"

    def _tp_sum_layers(self, values: torch.Tensor, replicated: list[bool]) -> torch.Tensor:
        """Sum per-layer partial statistics over TP; rows flagged replicated are already full."""
        tp = group_size(self.groups.tp)
        if tp == 1:
            return values
        mask = torch.tensor(replicated, device=values.device)
        values = torch.where(mask[:, None], values / tp, values)
        return all_reduce_sum(values, self.groups.tp)

    def _mp_sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self.groups.mp)

    @torch.no_grad()
    def relative_update_norm(self, update: PreparedUpdate, alpha: float = 1.0) -> float:
        """``‖ΔW‖_F / ‖W‖_F`` over all targets for step size ``alpha`` (through the r×r Gram)."""
        if update.skipped:
            return 0.0
        tp_rank = self.groups.tp_rank
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for t in self.targets:
            if self._replicated_on_tp(t) and tp_rank != 0:
                continue
            proj_RI = self.sketches.projection_for(t, update.update_index)
            totals[0] += reconstructed_norm2(update.directions[t.key], proj_RI)
            weight = self.masters.get(t.key, t.weight)
            totals[1] += weight.double().pow(2).sum()
        totals = self._mp_sum(totals)
        return abs(alpha) * math.sqrt(totals[0].item() / max(totals[1].item(), 1e-300))

    @torch.no_grad()
    def native_relative_update_norm(self, native: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> float:
        """``‖Δθ‖_F / ‖θ‖_F`` of the trained non-targets' α = 1 change ``native`` (:meth:`native_deltas`),
        summed over the model-parallel group so every rank of it gets the same figure (collective: every
        rank of the group calls, with or without parameters of its own); 0 when nothing is trained."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for param, delta in native:
            totals[0] += delta.double().pow(2).sum()
            totals[1] += param.double().pow(2).sum()
        totals = self._mp_sum(totals)
        return math.sqrt(totals[0].item() / totals[1].item()) if totals[1].item() > 0 else 0.0

    @torch.no_grad()
    def master_drift(self) -> float:
        """``‖W − round(master)‖ / ‖round(master)‖`` over all targets with fp32 masters (0 without).

        Under sketch-delta sync the compute weights replay the engine's low-precision merges
        while the masters accumulate in fp32; this is how far the two have separated.
        """
        if not self.masters:
            return 0.0
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for t in self.targets:
            master = self.masters.get(t.key)
            if master is None:
                continue
            rounded = master.to(t.weight.dtype)
            totals[0] += (t.weight.double() - rounded.double()).pow(2).sum()
            totals[1] += rounded.double().pow(2).sum()
        totals = self._mp_sum(totals)
        return math.sqrt(totals[0].item() / max(totals[1].item(), 1e-300))
