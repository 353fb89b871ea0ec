"""Which linear modules sketch capture supports, how they are split, and what input they multiply.

Supported: ``nn.Linear``; megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear``; and
TransformerEngine linears (megatron's ``TELinear``, ``TEColumnParallelLinear``,
``TERowParallelLinear``, ``TELayerNormColumnParallelLinear``), recognised by their TE base class
(``transformer_engine.pytorch``'s ``Linear`` / ``LayerNormLinear``) without importing
``transformer_engine`` here, so CPU installs never load it.

``TELayerNormColumnParallelLinear`` fuses the norm into the GEMM: its forward input is the
*un-normalised* hidden state and megatron builds it with ``return_layernorm_output=False``. The
weight multiplies ``norm(x)``, so the captured input is recomputed from the module's own
``layer_norm_weight`` / ``layer_norm_bias``, ``eps``, ``normalization`` and ``zero_centered_gamma``
(the attributes TE's ``LayerNormLinear`` stores and megatron's
``split_te_layernorm_column_parallel_linear`` reads): fp32 statistics, output in the activation
dtype, as TE computes it. Turning ``return_layernorm_output`` on instead would change the module's
return arity under megatron's wrapper and add an extra FP8 cast of the norm output.

Sequence parallelism (``sequence_parallel`` on a TP group of size ``t``): a column-parallel layer
sees ``X`` sharded along the sequence (``[s/t, b, n_in]``) and gathers it inside; a row-parallel
layer sees the full sequence and reduce-scatters its output. Only the small projected activations
``P = X·Aᵀ`` (``[·, r]``) travel: column-parallel targets all-gather ``P`` along the sequence;
row-parallel targets reduce-scatter their per-rank partial ``P_k = X_k·A[:, cols_k]ᵀ`` so each rank
holds ``(Σ_k P_k)`` for its own sequence chunk, matching the output gradient it receives. The
row-parallel sketch then is a partial sum over sequence chunks, summed over the TP group as without
sequence parallelism. A TE ``TELinear`` in ``duplicated`` mode (full weight on every TP rank) sees only
its rank's tokens under sequence parallelism: its sketch is a partial sum over the TP group as well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["LinearInfo", "classify_linear", "is_transformer_engine_module", "normalized_input",
           "gather_sequence", "reduce_scatter_sequence"]


@dataclass
class LinearInfo:
    """How a target linear is split and what its weight multiplies."""

    parallel: str
    """``none`` | ``column`` | ``row``: how the layer is split over the TP group."""
    n_in: int
    """Input features of the full (unsharded) layer."""
    cols: Optional[range]
    """Global input columns this rank owns (row-parallel), or None for all."""
    sequence_parallel: bool = False
    """The layer runs under sequence parallelism: ``P`` is gathered (column) or reduce-scattered (row)."""
    fused_norm: bool = False
    """The module applies a norm before its GEMM (TE ``LayerNormLinear``): capture ``norm(x)``."""
    backend: str = "torch"
    """``torch`` (nn.Linear), ``megatron`` (local tensor-parallel layers) or ``transformer_engine``."""


def is_transformer_engine_module(module: nn.Module) -> bool:
    """True when a class in ``module``'s MRO comes from the ``transformer_engine`` package."""
    return any(c.__module__.split(".")[0] == "transformer_engine" for c in type(module).__mro__)


def _tp(tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _row(weight: torch.Tensor, tp_group) -> tuple[int, range]:
    tp_size, tp_rank = _tp(tp_group)
    n_in_local = weight.shape[1]
    return n_in_local * tp_size, range(tp_rank * n_in_local, (tp_rank + 1) * n_in_local)


def _check_sp(module: nn.Module, name: str, tp_group) -> bool:
    sp = bool(getattr(module, "sequence_parallel", False))
    if sp and _tp(tp_group)[0] == 1:
        raise ValueError(f"target {name} runs with sequence_parallel but install_sketches got no tensor-parallel "
                         "group of size > 1; pass tp_group=groups.tp")
    return sp


def classify_linear(module: nn.Module, tp_group: Optional[dist.ProcessGroup], name: str = "") -> LinearInfo:
    """Split, full ``n_in``, owned columns, sequence parallelism and fused norm of a target linear.

    Raises:
        ValueError: an unsupported module type or split (gathered outputs, non-parallel row input,
            TE modules with split weight parameters).
    """
    if is_transformer_engine_module(module):
        return _classify_te(module, tp_group, name)
    try:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    except ImportError:  # plain torch usage
        ColumnParallelLinear = RowParallelLinear = ()  # type: ignore[assignment]
    if RowParallelLinear and isinstance(module, RowParallelLinear):
        if not module.input_is_parallel:
            raise ValueError(f"target {name}: RowParallelLinear targets must have input_is_parallel=True")
        n_in, cols = _row(module.weight, tp_group)
        return LinearInfo("row", n_in, cols, _check_sp(module, name, tp_group), backend="megatron")
    if ColumnParallelLinear and isinstance(module, ColumnParallelLinear):
        if module.gather_output:
            raise ValueError(f"target {name}: ColumnParallelLinear targets must have gather_output=False")
        return LinearInfo("column", module.weight.shape[1], None, _check_sp(module, name, tp_group), backend="megatron")
    if isinstance(module, nn.Linear):
        return LinearInfo("none", module.weight.shape[1], None)
    raise ValueError(
        f"target module {name} of type {type(module).__name__} is not supported; expected nn.Linear, "
        "megatron ColumnParallelLinear / RowParallelLinear or a TransformerEngine Linear / LayerNormLinear"
    )


def _classify_te(module: nn.Module, tp_group, name: str) -> LinearInfo:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"target {name}: TransformerEngine module {type(module).__name__} has no single 2-D 'weight' "
                         "parameter (parameters_split is not supported)")
    mode = getattr(module, "parallel_mode", None)
    fused = getattr(module, "layer_norm_weight", None) is not None
    if mode == "row":
        n_in, cols = _row(weight, tp_group)
        return LinearInfo("row", n_in, cols, _check_sp(module, name, tp_group), fused, "transformer_engine")
    if mode == "column":
        return LinearInfo("column", weight.shape[1], None, _check_sp(module, name, tp_group), fused, "transformer_engine")
    if mode is None:  # "duplicated": full weight on every TP rank; under SP it sees only local tokens
        sp = bool(getattr(getattr(module, "config", None), "sequence_parallel", False)) and _tp(tp_group)[0] > 1
        return LinearInfo("none", weight.shape[1], None, sp, fused, "transformer_engine")
    raise ValueError(f"target {name}: TransformerEngine parallel_mode={mode!r} is not supported")


def normalized_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` of a TE ``LayerNormLinear``: what its weight multiplies (fp32 math, ``x.dtype`` out).

    RMSNorm: ``x · rsqrt(mean(x²) + eps) · γ``; LayerNorm: ``(x − μ) · rsqrt(var + eps) · γ + β``;
    with ``zero_centered_gamma`` the scale is ``1 + γ``.
    """
    config = getattr(module, "config", None)
    norm = getattr(module, "normalization", None) or getattr(config, "normalization", "LayerNorm")
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(config, "layernorm_epsilon", 1e-5)
    zero_centered = bool(getattr(module, "zero_centered_gamma", False))
    xf = x.float()
    gamma = module.layer_norm_weight.float()
    if zero_centered:
        gamma = gamma + 1.0
    if norm == "RMSNorm":
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * gamma
    elif norm == "LayerNorm":
        mu = xf.mean(-1, keepdim=True)
        centered = xf - mu
        y = centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps) * gamma
        beta = getattr(module, "layer_norm_bias", None)
        if beta is not None:
            y = y + beta.float()
    else:
        raise ValueError(f"TransformerEngine normalization={norm!r} is not supported (RMSNorm or LayerNorm)")
    return y.to(x.dtype)


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``t`` along dim 0 (the sequence) over ``group``, in rank order."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty((t.shape[0] * world,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def reduce_scatter_sequence(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``t`` over ``group`` and keep this rank's chunk of dim 0 (the sequence)."""
    world = dist.get_world_size(group)
    if t.shape[0] % world:
        raise ValueError(f"sequence length {t.shape[0]} is not divisible by the TP size {world}")
    t = t.contiguous()
    out = torch.empty((t.shape[0] // world,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out
