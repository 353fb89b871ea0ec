"""Predicted KL of a LoGRA step by one forward-mode AD pass (DESIGN §1).

For the step ``ΔW_t = −D_t·A_t`` of every target ``t`` (α = 1), each target's forward hook
adds the tangent ``−(X·A_tᵀ)·D_tᵀ`` to its output, so the logits' tangent is ``δz = J·Δθ``
for all layers at once while the weights stay untouched. When the step also changes trained
non-target parameters (the native AdamW: embeddings, norms, biases, output layer; scaled by α
with the rest), the probe is given those changes ``Δθ_native`` and the forward runs with each
such parameter replaced by the dual number ``(θ, Δθ_native)`` (``torch.func.functional_call``),
so ``δz`` covers the whole step. Per position, with ``p = softmax(z/τ)``::

    pred = ½ Σ_v p_v (δz_v/τ − Σ_u p_u δz_u/τ)²        (second-order KL(π_old ‖ π_new))

averaged over valid positions in float64, chunk by chunk, with vocabulary-parallel logits
reduced over the TP group. Row-parallel targets hold a column block of ``X``: their partial
tangents are summed over TP. Forward-mode tangents cannot cross pipeline stages, so under
pipeline parallelism the probe is the finite-difference one.

Kernels without forward-mode rules (TransformerEngine, FP8), sequence parallelism and pipeline
parallelism take the finite-difference probe of :mod:`megatron_logra.kl.fd_probe` instead
(:func:`probe_method` resolves ``kl.probe=auto``); both share the logits helpers and
:func:`measure_kl` defined here, and the KL terms of :mod:`megatron_logra.kl.terms`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from torch import nn

from megatron_logra.kl import forward_ad
from megatron_logra.kl.controller import PROBE_METHODS, KLControlError
from megatron_logra.kl.terms import (
    CHUNK_BYTES,
    _global_mean,
    chunk_rows,
    exact_kl_terms,
    mean_predicted,
    predicted_kl_terms,
)
from megatron_logra.models.te import without_fp8
from megatron_logra.parallel import ParallelGroups, collective_device, group_size
from megatron_logra.sketch.sketch_set import SketchSet
from megatron_logra.sketch.targets import SketchTarget

logger = logging.getLogger(__name__)

__all__ = ["NativeDeltas", "flat_valid", "output_hooks", "tangent_hooks", "predicted_kl_terms", "exact_kl_terms", "predicted_kl", "probe_method",
           "probe_logits", "mean_predicted", "from_last_stage", "measure_kl", "ProbeBatch", "PROBE_METHODS",
           "CHUNK_BYTES", "chunk_rows"]


NativeDeltas = Sequence[tuple[torch.nn.Parameter, torch.Tensor]]
"""``(parameter, change at α = 1)`` of the trained non-target parameters of this rank (this stage's,
this TP rank's shard); empty when they are frozen
(:meth:`megatron_logra.optim.logra.LograOptimizer.native_deltas`)."""


class ProbeBatch:
    """Token ids, position ids and the mask of generated positions (``[b, s]``, aligned with labels)."""

    def __init__(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.tokens = tokens
        self.position_ids = position_ids
        self.mask = mask.bool()

    def to(self, device: torch.device) -> "ProbeBatch":
        """The same batch on ``device`` (the model's: the probes call the model directly)."""
        return ProbeBatch(self.tokens.to(device), self.position_ids.to(device), self.mask.to(device))


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode within the context, each restored to its own mode after.

    The probes measure the policy the engine samples from: no dropout. And megatron runs
    ``recompute_granularity=full`` only in training mode, where its checkpointed forward drops
    forward-mode tangents (the probe then sees none); probe forwards need no recompute (no graph).
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _primal(x: torch.Tensor) -> torch.Tensor:
    return fwAD.unpack_dual(x).primal


@contextlib.contextmanager
def output_hooks(
    sketches: SketchSet, edit: Callable[[SketchTarget, torch.Tensor, torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Within the context, every target module's output ``y`` (the first element of a tuple
    output) becomes ``edit(target, x, y)``, with ``x`` the module's forward input."""
    handles = []

    def make_hook(target):
        def hook(module, args, kwargs, output):
            x = args[0] if args else next(iter(kwargs.values()))
            if isinstance(output, tuple):
                return (edit(target, x, output[0]),) + tuple(output[1:])
            return edit(target, x, output)

        return hook

    for t in sketches.targets:
        handles.append(t.module.register_forward_hook(make_hook(t), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def tangent_hooks(
    sketches: SketchSet, directions: dict[str, torch.Tensor], update_index: int, tp_group=None
) -> Iterator[None]:
    """Within the context, every target's output carries the tangent of ``ΔW = −D·A``."""
    forward_ad.enable()

    def add_tangent(target, x, out):
        proj_RI = sketches.projection_for(target, update_index)
        tangent = -torch.matmul(torch.matmul(_primal(x).to(torch.float32), proj_RI.t()), directions[target.key].t())
        if target.partial and group_size(tp_group) > 1:
            dist.all_reduce(tangent, group=tp_group)
        return out + fwAD.make_dual(torch.zeros_like(_primal(out)), tangent.to(out.dtype))

    with output_hooks(sketches, add_tangent):
        yield


def probe_method(method: str, sketches: SketchSet, pp_size: int = 1) -> str:
    """Resolve ``auto``: the finite-difference probe when a target is a TransformerEngine module
    (no forward-mode rules), runs under sequence parallelism, or under pipeline parallelism
    (tangents cannot cross stages); else forward-mode AD."""
    if method not in PROBE_METHODS:
        raise ValueError(f"kl.probe={method!r}: choose one of {PROBE_METHODS}")
    if method == "jvp" and pp_size > 1:
        raise ValueError("kl.probe=jvp cannot run under pipeline parallelism (tangents do not cross stages); "
                         "use kl.probe=finite_difference or auto")
    te = any(getattr(t, "backend", "") == "transformer_engine" for t in sketches.targets)
    sp = any(t.sequence_parallel for t in sketches.targets)  # the jvp rules do not cover SP's sequence scatter
    if method == "jvp" and (te or sp):
        raise ValueError("kl.probe=jvp cannot differentiate through TransformerEngine kernels or sequence parallelism; "
                         "use kl.probe=finite_difference or auto")
    if method != "auto":
        return method
    return "finite_difference" if te or sp or pp_size > 1 else "jvp"


def flat_valid(x_bsV: torch.Tensor, mask_bs: torch.Tensor) -> torch.Tensor:
    return x_bsV.reshape(-1, x_bsV.shape[-1])[mask_bs.reshape(-1)]


@torch.no_grad()
def predicted_kl(
    model: nn.Module,
    sketches: SketchSet,
    directions: dict[str, torch.Tensor],
    update_index: int,
    batch: ProbeBatch,
    groups: ParallelGroups,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    native: NativeDeltas = (),
) -> tuple[float, torch.Tensor]:
    """(mean predicted KL of the α = 1 step over valid positions, primal logits of valid positions).

    ``native``: the changes of trained non-target parameters in the same step (:data:`NativeDeltas`);
    they enter as the tangents of those parameters, so the prediction covers the whole step.
    Empty (frozen non-targets): the plain forward, nothing extra.

    Raises :class:`KLControlError` when the tangent is lost (a target was never reached),
    there are no valid positions, or the prediction is not finite.
    """
    if groups.pp_size > 1:
        raise NotImplementedError("forward-mode tangents cannot cross pipeline stages: use predicted_kl_fd (kl.probe=auto)")
    with fwAD.dual_level(), tangent_hooks(sketches, directions, update_index, groups.tp), eval_mode(model):
        args = (batch.tokens, batch.position_ids, None)
        if native:
            logits = torch.func.functional_call(model, _dual_parameters(model, native), args)
        else:
            logits = model(*args)
        z, dz = fwAD.unpack_dual(logits)
        if dz is None:
            raise KLControlError("the KL probe lost its tangent: no target contributed to the logits")
        z_NV = flat_valid(z, batch.mask)
        dz_NV = flat_valid(dz, batch.mask)
    return mean_predicted(z_NV, dz_NV, temperature, groups, chunk), z_NV.detach()


def parameter_names(model: nn.Module, params: Sequence[torch.nn.Parameter]) -> list[str]:
    """The name of each of ``params`` in ``model`` (a ``ValueError`` for one that is not there)."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"{len(missing)} parameters with a planned change (shapes {missing[:3]}) are not "
                         "parameters of the probed model")
    return [names[id(p)] for p in params]


def _dual_parameters(model: nn.Module, native: NativeDeltas) -> dict[str, torch.Tensor]:
    """Parameter name -> dual number ``(θ, Δθ)`` (inside a ``fwAD.dual_level``)."""
    names = parameter_names(model, [p for p, _ in native])
    return {name: fwAD.make_dual(p.detach(), delta.to(dtype=p.dtype, device=p.device))
            for name, (p, delta) in zip(names, native)}


def probe_logits(model, batch: ProbeBatch, groups: ParallelGroups) -> Optional[torch.Tensor]:
    """Logits of the probe's valid positions (this TP rank's vocabulary shard, ``[N, V/tp]``).

    Under pipeline parallelism the forward runs through megatron's forward-only schedule and only
    the last stage gets the logits; the other stages return None. Every probe forward (the
    finite-difference ones, the measured KL's) runs with FP8 off
    (:func:`megatron_logra.models.te.without_fp8`), so all of them see the same 16-bit policy.
    """
    if groups.pp_size == 1:
        with eval_mode(model), without_fp8(model):
            return flat_valid(model(batch.tokens, batch.position_ids, None), batch.mask)
    from megatron_logra.train.step import Batch, forward_backward

    kept: list[torch.Tensor] = []

    def keep(mb: Batch, logits: torch.Tensor):
        kept.append(flat_valid(logits, mb.loss_mask.bool()).detach())
        zero = logits.sum() * 0.0
        return zero, mb.loss_mask.sum().to(torch.int), {"lm": torch.stack([zero.detach().float(), mb.loss_mask.sum()])}

    mask = batch.mask.float()
    with eval_mode(model), without_fp8(model):
        forward_backward(model, [Batch(batch.tokens, batch.tokens, mask, batch.position_ids)], groups,
                         forward_only=True, loss_fn=keep)
    return kept[0] if groups.pp_last else None


def from_last_stage(compute: Callable[[], float], groups: ParallelGroups, what: str) -> float:
    """``compute()`` run on the last pipeline stage, its value on every stage. When it fails with
    :class:`KLControlError` (or is not finite) every stage raises, so no stage is left waiting."""
    if groups.pp_size == 1:
        value = compute()
    else:
        value = float("nan")
        if groups.pp_last:
            try:
                value = compute()
            except KLControlError:
                pass  # NaN: every stage raises below
        buf = torch.tensor([value], dtype=torch.float64, device=collective_device(groups.pp))
        dist.broadcast(buf, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
        value = buf.item()
    if not math.isfinite(value):
        raise KLControlError(f"{what} is not finite ({value}) on the last pipeline stage")
    return value


@torch.no_grad()
def measure_kl(
    model: nn.Module,
    batch: ProbeBatch,
    old_logits_NV: torch.Tensor,
    groups: ParallelGroups,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> float:
    """Mean exact ``KL(π_old ‖ π_now)`` over the probe's valid positions (on every pipeline stage;
    ``old_logits_NV`` is needed on the last stage only)."""
    new_NV = probe_logits(model, batch, groups)

    def mean_exact() -> float:
        total = torch.zeros((), dtype=torch.float64, device=new_NV.device)
        rows = chunk_rows(chunk, new_NV.shape[-1])
        for start in range(0, new_NV.shape[0], rows):
            total += exact_kl_terms(old_logits_NV[start : start + rows], new_NV[start : start + rows], temperature,
                                    groups.tp).sum()
        return _global_mean(total, torch.tensor(new_NV.shape[0], device=new_NV.device), groups.dp)

    return from_last_stage(mean_exact, groups, "the measured KL")
