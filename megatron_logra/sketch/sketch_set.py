"""A model's sketches at run time: the flat fp32 buffer, the projections, and the forward hook whose identity
autograd function adds ``Hᵀ P`` to a target's sketch in the backward pass.

The hook computes ``P = X Aᵀ`` under ``no_grad`` and only when grad mode is on, so an activation recompute
adds ``Hᵀ P`` once; under sequence parallelism only ``P`` moves between TP ranks, never ``X``. Row-parallel
targets (and replicated ones under sequence parallelism) hold partial sketches until
:meth:`SketchSet.reduce_tensor_parallel` sums them over the TP group.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_logra.sketch.layers import gather_sequence, normalized_input, reduce_scatter_sequence
from megatron_logra.sketch.random_projection import projection
from megatron_logra.sketch.targets import SketchTarget

__all__ = ["SketchSet"]


class _SketchCapture(torch.autograd.Function):
    """Identity on the layer output whose backward accumulates ``Hᵀ P`` into the sketch.

    The output shares ``out``'s storage and version counter but is not an autograd view of it:
    a consumer may modify it in place, as megatron's vocab-parallel cross entropy does with the
    logits of ``output_layer`` (autograd forbids in-place changes to a custom Function's view
    output). Nothing saves ``out`` for backward, and the shared version counter still catches any
    later use of a stale value."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, proj_in: torch.Tensor, anchor: torch.Tensor, target: SketchTarget):
        ctx.save_for_backward(proj_in)
        ctx.target = target
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (proj_in,) = ctx.saved_tensors
        sketch_OR: torch.Tensor = ctx.target.sketch
        grad_TO = grad_out.reshape(-1, grad_out.shape[-1])
        proj_TR = proj_in.reshape(-1, proj_in.shape[-1])
        if grad_TO.dtype == torch.float32 and proj_TR.dtype == torch.float32:
            sketch_OR.addmm_(grad_TO.t(), proj_TR)
        else:
            sketch_OR.addmm_(grad_TO.t().float(), proj_TR.float())
        return grad_out, None, None, None


class SketchSet:
    """All sketches of a model: targets, the flat fp32 buffer, projection bookkeeping.

    ``update`` is the projection update index in use; the optimizer calls ``advance()``
    after each applied step (a no-op for the index when ``refresh`` is off).
    """

    def __init__(
        self,
        targets: list[SketchTarget],
        rank: int,
        seed: int,
        distribution: str,
        refresh: bool,
        tp_group: Optional[dist.ProcessGroup],
        cache_projections: bool,
        device: Optional[torch.device] = None,
    ) -> None:
        """``device``: where the buffer lives when ``targets`` is empty (a pipeline stage without
        targets); otherwise the targets' weights' device."""
        self.targets = targets
        self.rank = rank
        self.seed = seed
        self.distribution = distribution
        self.refresh = refresh
        self.tp_group = tp_group
        self.cache_projections = cache_projections
        self.num_updates = 0
        self.capture_enabled = True
        self._cache: dict[tuple[str, int], torch.Tensor] = {}
        self._handles: list = []
        device = targets[0].weight.device if targets else (device or torch.device("cpu"))
        num_rows = sum(t.n_out_local for t in targets)
        self.flat = torch.zeros(num_rows, rank, dtype=torch.float32, device=device)
        offset = 0
        for t in targets:
            t.row_offset = offset
            t.sketch = self.flat[offset : offset + t.n_out_local]
            offset += t.n_out_local
        # Makes every capture output require grad even when all parameters are frozen,
        # so backward reaches the sketches (DESIGN: the "embedding hook" requirement).
        self._anchor = torch.zeros(0, device=device, requires_grad=True)

    # ------------------------------------------------------------------ projections
    @property
    def update(self) -> int:
        """Projection update index of the step being accumulated."""
        return self.num_updates if self.refresh else 0

    def projection_for(self, target: SketchTarget, update: Optional[int] = None) -> torch.Tensor:
        """fp32 ``[r, len(cols)]``: the columns of ``A`` this rank applies to ``target``."""
        update = self.update if update is None else update
        key = (target.name + (f"|{target.cols.start}:{target.cols.stop}" if target.cols else ""), update)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        proj_RI = projection(
            self.seed, target.name, update, self.rank, target.n_in,
            distribution=self.distribution, cols=target.cols, device=target.weight.device,
        )
        if self.cache_projections:
            self._cache[key] = proj_RI
        return proj_RI

    def advance(self) -> None:
        """Move to the next update index and drop cached projections of the old one."""
        self.num_updates += 1
        if self.refresh:
            self._cache.clear()

    def seek(self, num_updates: int) -> None:
        """Continue after ``num_updates`` applied updates (resuming a run): drop every cached projection."""
        self.num_updates = num_updates
        self._cache.clear()

    # ------------------------------------------------------------------ buffer ops
    def zero_(self) -> None:
        self.flat.zero_()

    def reduce_tensor_parallel(self) -> None:
        """Sum the partial sketches of row-parallel targets over the TP group (one collective)."""
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return
        partial = [t for t in self.targets if t.partial]
        if not partial:
            return
        packed = torch.cat([t.sketch.reshape(-1) for t in partial])
        dist.all_reduce(packed, group=self.tp_group)
        offset = 0
        for t in partial:
            n = t.sketch.numel()
            t.sketch.copy_(packed[offset : offset + n].view_as(t.sketch))
            offset += n

    def sketches(self) -> dict[str, torch.Tensor]:
        """Target key -> sketch view (rows local to this TP rank)."""
        return {t.key: t.sketch for t in self.targets}

    @contextlib.contextmanager
    def paused(self):
        """Forward passes inside this context capture nothing (evaluation, probes)."""
        prev = self.capture_enabled
        self.capture_enabled = False
        try:
            yield
        finally:
            self.capture_enabled = prev

    def remove(self) -> None:
        """Remove the hooks (weights stay frozen)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hook
    def target_input(self, target: SketchTarget, x: torch.Tensor) -> torch.Tensor:
        """The input ``X`` the target's weight multiplies, given the module's forward input ``x``
        (``norm(x)`` for a fused TE ``LayerNormLinear``; this rank's shard under TP / SP)."""
        return normalized_input(target.module, x) if target.fused_norm else x

    @torch.no_grad()
    def project_input(self, target: SketchTarget, x: torch.Tensor) -> torch.Tensor:
        """``P = X·Aᵀ`` aligned with the output gradient this rank receives.

        Column-parallel targets under sequence parallelism all-gather ``P`` along the sequence;
        row-parallel ones reduce-scatter their partial ``P`` (in fp32) so each rank holds the
        sum over TP for its own sequence chunk."""
        x = self.target_input(target, x.detach())
        proj_in = torch.matmul(x, self.projection_for(target).to(x.dtype).t())
        if target.sequence_parallel:
            if target.parallel == "row":
                proj_in = reduce_scatter_sequence(proj_in.float(), self.tp_group)
            elif target.parallel == "column":
                proj_in = gather_sequence(proj_in, self.tp_group)
        return proj_in

    def _make_hook(self, target: SketchTarget) -> Callable:
        def hook(module, args, kwargs, output):
            if not (self.capture_enabled and torch.is_grad_enabled()):
                return None
            x = args[0] if args else next(iter(kwargs.values()))
            proj_in = self.project_input(target, x)
            if isinstance(output, tuple):
                return (_SketchCapture.apply(output[0], proj_in, self._anchor, target),) + tuple(output[1:])
            return _SketchCapture.apply(output, proj_in, self._anchor, target)

        return hook
