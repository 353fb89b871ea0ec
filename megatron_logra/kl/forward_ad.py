"""Forward-mode AD rules for megatron-core's custom autograd Functions.

The predicted-KL probe pushes a tangent through the policy with ``torch.autograd.forward_ad``.
Built-in torch ops have forward-mode rules; megatron-core's own ``autograd.Function``s (the
frozen-weight linear and the tensor-parallel region mappings) define only ``backward``, so
forward AD through them fails. ``enable()`` adds a ``jvp`` to each, and makes their
``forward`` keep what the ``jvp`` needs. The rules are exact: each Function is linear in
its tensor input (weights are constants of the probe), so its tangent map is the forward map.

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
        from megatron.core.tensor_parallel import layers, mappings

        # ---- frozen-weight linear: y = x Wᵀ + b  ->  ẏ = ẋ Wᵀ (W, b constant)
        frozen = layers.LinearWithFrozenWeight
        orig_forward = frozen.forward

        def frozen_forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
            ctx.jvp_weight = weight
            return orig_forward(ctx, input, weight, bias, allreduce_dgrad, tp_group)

        def frozen_jvp(ctx, input_t, weight_t, bias_t, *unused):
            out = torch.matmul(input_t, ctx.jvp_weight.t()) if input_t is not None else None
            if (weight_t is not None and bool(weight_t.any())) or (bias_t is not None and bool(bias_t.any())):
                raise RuntimeError("forward AD through a frozen megatron linear cannot carry weight tangents")
            return out

        frozen.forward = staticmethod(frozen_forward)
        frozen.jvp = staticmethod(frozen_jvp)

        # ---- trainable linear (non-target layers such as the output layer): same rule, the
        # probe never gives weights a tangent
        trainable = layers.LinearWithGradAccumulationAndAsyncCommunication
        orig_trainable_forward = trainable.forward

        def trainable_forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                              sequence_parallel, *rest):
            if sequence_parallel and torch.autograd.forward_ad._current_level >= 0:
                raise NotImplementedError("the forward-AD probe does not support sequence parallelism: use kl.probe=auto or finite_difference")
            ctx.jvp_weight = weight
            return orig_trainable_forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                          sequence_parallel, *rest)

        trainable.forward = staticmethod(trainable_forward)
        trainable.jvp = staticmethod(frozen_jvp)

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
        _ENABLED = True
