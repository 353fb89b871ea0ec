"""Predicted KL by central finite differences, for what forward-mode AD cannot go through.

Forward hooks add ``±h·(−(X·Aᵀ)·Dᵀ)`` to the target outputs as a *primal* perturbation -- the exact output of ``W ∓ h·D·A``, weights
untouched -- and the logits' tangent is the central difference ``δz = (z₊ − z₋) / 2h``, exact up
to ``O(h²)``. It runs three no-grad forwards (base, +h, −h; five when trained non-targets take their
own step, below) and works under sequence parallelism
(the small ``X·Aᵀ`` is gathered or reduce-scattered like the sketch capture does) and pipeline
parallelism: each stage perturbs its own targets inside megatron's forward-only schedule, the
last stage computes the prediction (and the measured KL) and broadcasts it to the other stages.
The prediction is the same second-order KL as the forward-mode probe's, from the same
per-position terms; :func:`megatron_logra.kl.probe.probe_method` decides which probe runs.

Trained non-target parameters (the native AdamW's part of the step) are perturbed in place by
``±h'·Δθ`` (:func:`shifted_parameters`; each pipeline stage its own) and restored bit for bit from a
saved copy after each. Their step ``h'`` is sized by their own relative change (:func:`fd_step`),
and when it differs from the targets' ``h`` each part is differenced on its own.
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
from megatron_logra.sketch.sketch_set import SketchSet

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


def _central_difference(model: nn.Module, batch: ProbeBatch, groups: ParallelGroups, sketches: SketchSet,
                        directions: Optional[dict[str, torch.Tensor]], native: NativeDeltas,
                        step: float) -> Optional[torch.Tensor]:
    """``(z(+h) − z(−h)) / 2h`` of the valid positions' logits (fp32; None off the last stage) for the
    targets moved along ``directions`` (None: left alone) and ``native`` shifted by ``±h·Δθ``."""

    def logits(scale: float) -> Optional[torch.Tensor]:
        hooks = (perturbation_hooks(sketches, directions, scale, groups.tp) if directions is not None
                 else contextlib.nullcontext())
        with hooks, shifted_parameters(native, scale):
            return probe_logits(model, batch, groups)

    plus_NV = logits(step)
    plus_NV = plus_NV.float() if plus_NV is not None else None  # probe_logits returns a fresh tensor: in place is safe
    minus_NV = logits(-step)
    return None if plus_NV is None else plus_NV.sub_(minus_NV).div_(2.0 * step)


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
    native_step: Optional[float] = None,
) -> tuple[float, Optional[torch.Tensor]]:
    """:func:`predicted_kl` by a central difference of step ``h = step`` in units of the α = 1 update.

    The default ``h = 1`` differences across the very step being planned, so the prediction
    holds where it is used; the error of ``δz`` is third order in ``h``. Returns the prediction
    (on every pipeline stage) and the base logits of the valid positions (last stage; None on
    the others). ``native``: this rank's trained non-target parameters and their changes in the
    same step (:data:`~megatron_logra.kl.probe.NativeDeltas`), perturbed by ``±h'·Δθ`` with
    ``h' = native_step`` (None: ``step``) and restored exactly. The logits' tangent is linear in the
    two parts, so with ``h' ≠ h`` each part is differenced on its own (five forwards instead of
    three): a step sized for the targets' tiny relative update (``h`` ≈ 80 for bf16 at the paper's
    6e-5) would move the natives, whose AdamW change is relatively far larger, out of the range
    where the second-order prediction holds. ``native_step`` must be the same on every rank of the
    model-parallel group (it scales the last stage's tangent, and decides how many forwards every
    pipeline stage runs, also one without trained non-targets). Raises
    :class:`~megatron_logra.kl.controller.KLControlError` (on every stage) when there are no valid
    positions or the prediction is not finite; logs a warning when the perturbation does not change
    the logits at all.
    """
    native_step = step if native_step is None else native_step
    for name, value in (("kl.fd_step", step), ("the native finite-difference step", native_step)):
        if not value > 0:
            raise ValueError(f"{name}={value} must be > 0")
    with sketches.paused():
        z_NV = probe_logits(model, batch, groups)
        if native_step == step:  # not on whether this rank has natives: every PP stage must run the same forwards
            dz_NV = _central_difference(model, batch, groups, sketches, directions, native, step)
        else:
            dz_NV = _central_difference(model, batch, groups, sketches, directions, (), step)
            native_NV = _central_difference(model, batch, groups, sketches, None, native, native_step)
            dz_NV = None if dz_NV is None else dz_NV.add_(native_NV)

    def predict() -> float:
        moved = any(directions[t.key].any() for t in sketches.targets) or any(bool(d.any()) for _, d in native)
        if moved and not bool(dz_NV.any()):
            logger.warning("the finite-difference KL probe saw no change of the logits (step below their precision?)")
        return mean_predicted(z_NV, dz_NV, temperature, groups, chunk)

    pred = from_last_stage(predict, groups, "the finite-difference KL prediction")
    return pred, (z_NV.detach() if z_NV is not None else None)
