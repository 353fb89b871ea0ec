"""Predicted KL by central finite differences, for what forward-mode AD cannot go through.

Forward hooks add ``±h·(−(X·Aᵀ)·Dᵀ)`` to the target outputs as a *primal* perturbation -- the exact output of ``W ∓ h·D·A``, weights
untouched -- and the logits' tangent is the central difference ``δz = (z₊ − z₋) / 2h``, exact up
to ``O(h²)``. It runs three no-grad forwards (base, +h, −h) and works under sequence parallelism
(the small ``X·Aᵀ`` is gathered or reduce-scattered like the sketch capture does) and pipeline
parallelism: each stage perturbs its own targets inside megatron's forward-only schedule, the
last stage computes the prediction (and the measured KL) and broadcasts it to the other stages.
The prediction is the same second-order KL as the forward-mode probe's, from the same
per-position terms; :func:`megatron_logra.kl.probe.probe_method` decides which probe runs.

Trained non-target parameters (the native AdamW's part of the step) are perturbed in place by
``±h·Δθ`` for the ``±h`` forwards (:func:`shifted_parameters`; each pipeline stage its own) and
restored bit for bit from a saved copy after each.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.kl.probe import (
    NativeDeltas,
    ProbeBatch,
    from_last_stage,
    mean_predicted,
    output_hooks,
    probe_logits,
)
from megatron_logra.parallel import ParallelGroups, group_size
from megatron_logra.sketch.capture import SketchSet

logger = logging.getLogger(__name__)

__all__ = ["perturbation_hooks", "shifted_parameters", "fd_step", "predicted_kl_fd"]


@contextlib.contextmanager
def perturbation_hooks(
    sketches: SketchSet, directions: dict[str, torch.Tensor], scale: float, tp_group=None
) -> Iterator[None]:
    """Within the context, every target's output is that of ``W − scale·D·A`` (weights untouched).

    ``X·Aᵀ`` comes from :meth:`SketchSet.project_input` (normalised input of a fused
    ``LayerNormLinear``, sequence-parallel gather / reduce-scatter); a row-parallel target
    without sequence parallelism sums its partial ``X_k·A_kᵀ`` over TP first.
    """

    def perturb(target, x, out):
        proj_in = sketches.project_input(target, x).float()
        if target.parallel == "row" and not target.sequence_parallel and group_size(tp_group) > 1:
            dist.all_reduce(proj_in, group=tp_group)
        delta = torch.matmul(proj_in, directions[target.key].float().t()).mul_(-scale)
        return (out.float() + delta).to(out.dtype)

    with output_hooks(sketches, perturb):
        yield


@contextlib.contextmanager
def shifted_parameters(native: NativeDeltas, scale: float) -> Iterator[None]:
    """Within the context each parameter ``θ`` of ``native`` holds ``θ + scale·Δθ`` (computed in fp32,
    rounded to the parameter's dtype); afterwards the saved original, bit for bit. Nothing to do
    (and nothing saved) when ``native`` is empty."""
    saved = [p.detach().clone() for p, _ in native]
    try:
        with torch.no_grad():
            for p, delta in native:
                p.copy_(p.float().add_(delta.to(device=p.device, dtype=torch.float32), alpha=scale))
        yield
    finally:
        with torch.no_grad():
            for (p, _), original in zip(native, saved):
                p.copy_(original)


def fd_step(fixed: float, min_relative: float, relative_update: float, weight_dtype: torch.dtype) -> float:
    """Step ``h`` of the finite-difference probe (in units of the α = 1 update).

    ``fixed`` > 0 is used as is. Otherwise fp32/fp64 targets take ``h = 1`` (difference across the
    planned step); low-precision targets take ``h = max(1, min_relative / relative_update)``, where
    ``relative_update`` is ``‖ΔW‖/‖W‖`` at α = 1: a bf16 output cannot resolve a perturbation much
    below its own 2⁻⁸ spacing, and a central difference stays accurate to ``O(h²)`` well beyond it.
    """
    if fixed > 0:
        return fixed
    if weight_dtype in (torch.float32, torch.float64) or relative_update <= 0:
        return 1.0
    return max(1.0, min_relative / relative_update)


@torch.no_grad()
def predicted_kl_fd(
    model: nn.Module,
    sketches: SketchSet,
    directions: dict[str, torch.Tensor],
    batch: ProbeBatch,
    groups: ParallelGroups,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    step: float = 1.0,
    native: NativeDeltas = (),
) -> tuple[float, Optional[torch.Tensor]]:
    """:func:`predicted_kl` by a central difference of step ``h = step`` in units of the α = 1 update.

    The default ``h = 1`` differences across the very step being planned, so the prediction
    holds where it is used; the error of ``δz`` is third order in ``h``. Returns the prediction
    (on every pipeline stage) and the base logits of the valid positions (last stage; None on
    the others). ``native``: this rank's trained non-target parameters and their changes in the
    same step (:data:`~megatron_logra.kl.probe.NativeDeltas`), perturbed by ``±h·Δθ`` alongside the
    targets and restored exactly. Raises :class:`~megatron_logra.kl.controller.KLControlError` (on every stage)
    when there are no valid positions or the prediction is not finite; logs a warning when the
    perturbation does not change the logits at all.
    """
    if not step > 0:
        raise ValueError(f"kl.fd_step={step} must be > 0")
    with sketches.paused():
        z_NV = probe_logits(model, batch, groups)
        with perturbation_hooks(sketches, directions, step, groups.tp), shifted_parameters(native, step):
            dz_NV = probe_logits(model, batch, groups)
        dz_NV = dz_NV.float() if dz_NV is not None else None  # probe_logits returns a fresh tensor: in place is safe
        with perturbation_hooks(sketches, directions, -step, groups.tp), shifted_parameters(native, -step):
            minus_NV = probe_logits(model, batch, groups)

    def predict() -> float:
        dz_NV.sub_(minus_NV).div_(2.0 * step)
        moved = any(directions[t.key].any() for t in sketches.targets) or any(bool(d.any()) for _, d in native)
        if moved and not bool(dz_NV.any()):
            logger.warning("the finite-difference KL probe saw no change of the logits (step below their precision?)")
        return mean_predicted(z_NV, dz_NV, temperature, groups, chunk)

    pred = from_last_stage(predict, groups, "the finite-difference KL prediction")
    return pred, (z_NV.detach() if z_NV is not None else None)
