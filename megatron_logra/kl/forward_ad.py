"""Forward-mode AD rules for megatron-core's custom autograd Functions.

The predicted-KL probe pushes a tangent through the policy with ``torch.autograd.forward_ad``.
Built-in torch ops have forward-mode rules; megatron-core's own ``autograd.Function``s (the
frozen-weight linear, the tensor-parallel region mappings and ``MakeViewlessTensor``, which a
transformer layer applies to its output when that is a view) define only ``backward``, so
forward AD through them fails. ``enable()`` adds a ``jvp`` to each, and makes their
``forward`` keep what the ``jvp`` needs. The rules are exact: the region mappings are linear,
so their tangent map is the forward map; a linear ``y = x·Wᵀ + b`` has ``ẏ = ẋ·Wᵀ + x·Ẇᵀ + ḃ``,
where ``Ẇ`` and ``ḃ`` are nonzero only when the probe gives trained non-target weights (the
output layer) their planned change as tangent. The input ``x`` is kept only while a forward-AD
level is active, so training forwards keep nothing extra.

This is the only place megatron-core is patched for forward AD; it changes no forward or
backward result.
"""

from __future__ import annotations

import functools
import threading

import torch

__all__ = ["enable"]

_LOCK = threading.Lock()
_ENABLED = False


def _as_view(result: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
    # A Function whose forward returns its input (TP size 1, or megatron's in-place
    # all-reduce) must return a view from its jvp as well.
    return result.view_as(result) if result is tangent else result


def _keep_for_jvp(ctx, input: torch.Tensor, weight: torch.Tensor) -> None:
    ctx.jvp_weight = weight
    # the input only under forward AD (the probe): a training forward of a frozen linear keeps no input
    ctx.jvp_input = input if torch.autograd.forward_ad._current_level >= 0 else None


def _linear_jvp(ctx, input_t, weight_t, bias_t, *unused):
    """``ẏ = ẋ·Wᵀ + x·Ẇᵀ + ḃ`` (absent tangents are zero)."""
    weight = ctx.jvp_weight
    out = torch.matmul(input_t, weight.t()) if input_t is not None else None
    if weight_t is not None:
        if ctx.jvp_input is None:
            raise RuntimeError("forward AD through a megatron linear lost its input")
        term = torch.matmul(ctx.jvp_input, weight_t.t())
        out = term if out is None else out + term
    if bias_t is not None:
        if out is None:
            out = torch.zeros(*ctx.jvp_input.shape[:-1], weight.shape[0], dtype=bias_t.dtype, device=bias_t.device)
        out = out + bias_t
    return out


def _keep_group_forward(forward):
    @functools.wraps(forward)
    def wrapped(ctx, input_, group, *args):
        ctx.group = group
        return forward(ctx, input_, group, *args)

    return staticmethod(wrapped)


def enable() -> None:
    """Install the jvp rules (idempotent)."""
    global _ENABLED
    with _LOCK:
        if _ENABLED:
            return
        from megatron.core import utils as mcore_utils
        from megatron.core.tensor_parallel import layers, mappings

        # ---- frozen-weight linear: y = x Wᵀ + b  ->  ẏ = ẋ Wᵀ + x Ẇᵀ + ḃ
        frozen = layers.LinearWithFrozenWeight
        orig_forward = frozen.forward

        def frozen_forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
            _keep_for_jvp(ctx, input, weight)
            return orig_forward(ctx, input, weight, bias, allreduce_dgrad, tp_group)

        frozen.forward = staticmethod(frozen_forward)
        frozen.jvp = staticmethod(_linear_jvp)

        # ---- trainable linear (non-target layers such as the output layer): same rule; its weight
        # carries a tangent when the probe predicts the native AdamW step as well
        trainable = layers.LinearWithGradAccumulationAndAsyncCommunication
        orig_trainable_forward = trainable.forward

        def trainable_forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                              sequence_parallel, *rest):
            if sequence_parallel and torch.autograd.forward_ad._current_level >= 0:
                raise NotImplementedError("the forward-AD probe does not support sequence parallelism: use kl.probe=auto or finite_difference")
            _keep_for_jvp(ctx, input, weight)
            return orig_trainable_forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                          sequence_parallel, *rest)

        trainable.forward = staticmethod(trainable_forward)
        trainable.jvp = staticmethod(_linear_jvp)

        # ---- tensor-parallel region maps: each is linear, so the tangent takes the same map
        mappings._CopyToModelParallelRegion.jvp = staticmethod(lambda ctx, t, g=None: t.view_as(t))
        mappings._ReduceFromModelParallelRegion.forward = _keep_group_forward(
            mappings._ReduceFromModelParallelRegion.forward
        )
        mappings._ReduceFromModelParallelRegion.jvp = staticmethod(
            lambda ctx, t, g=None: _as_view(mappings._reduce(t, ctx.group), t)
        )
        mappings._ScatterToModelParallelRegion.jvp = staticmethod(
            lambda ctx, t, g=None: _as_view(mappings._split_along_last_dim(t, ctx.group), t)
        )
        mappings._GatherFromModelParallelRegion.jvp = staticmethod(
            lambda ctx, t, g=None: _as_view(mappings._gather_along_last_dim(t, ctx.group), t)
        )
        # ---- MakeViewlessTensor: an identity (a new tensor on the input's storage) that megatron's
        # TransformerLayer applies to a layer output that is a view, e.g. the residual sum when linear_fc2
        # is not a target (its output then carries no tangent hook); the tangent passes through unchanged
        mcore_utils.MakeViewlessTensor.jvp = staticmethod(lambda ctx, t, requires_grad_t=None: t.clone())
        _ENABLED = True
