"""CPU stand-ins for TransformerEngine modules, and a megatron-core TP chain ending in one.

The stand-ins' classes live under a ``transformer_engine`` module path (what
``sketch.layers.classify_linear`` keys on) and behave like megatron's TE wrappers
(``LayerNormLinear``: norm then GEMM, both return ``(out, None)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "FakeTELayerNormLinear", "FakeTELinear", "parallel_chain"]


class FakeTELinear(nn.Module):
    """Stand-in for megatron's TELinear (duplicated: no TP): ``(x Wᵀ, None)``."""

    def __init__(self, n_in: int, n_out: int, parallel_mode=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.2)
        self.parallel_mode = parallel_mode

    def forward(self, x):
        return F.linear(x, self.weight), None


class FakeTELayerNormLinear(nn.Module):
    """Stand-in for TELayerNormColumnParallelLinear: ``(norm(x) Wᵀ, None)`` with TE's attributes."""

    def __init__(self, n_in: int, n_out: int, normalization: str, zero_centered_gamma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.2)
        base = 0.0 if zero_centered_gamma else 1.0
        self.layer_norm_weight = nn.Parameter(base + 0.3 * torch.randn(n_in))
        self.layer_norm_bias = nn.Parameter(0.3 * torch.randn(n_in)) if normalization == "LayerNorm" else None
        self.normalization, self.eps, self.zero_centered_gamma = normalization, 1e-5, zero_centered_gamma
        self.parallel_mode = None

    def forward(self, x):
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            y = F.rms_norm(x, (x.shape[-1],), gamma, self.eps)
        else:
            y = F.layer_norm(x, (x.shape[-1],), gamma, self.layer_norm_bias, self.eps)
        return F.linear(y, self.weight), None


FakeTELinear.__module__ = FakeTELayerNormLinear.__module__ = "transformer_engine.pytorch.module.fake"


class Block(nn.Module):
    """A fused norm+QKV stand-in feeding a plain TE-like projection (16 → 24 → 16)."""

    def __init__(self, normalization: str, zero_centered: bool):
        super().__init__()
        self.linear_qkv = FakeTELayerNormLinear(16, 24, normalization, zero_centered)
        self.linear_proj = FakeTELinear(24, 16)

    def forward(self, x):
        y, _ = self.linear_qkv(x)
        z, _ = self.linear_proj(torch.tanh(y))
        return z


def parallel_chain(world: int, rank: int, sp: bool, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> nn.Module:
    """``linear_fc1`` (column-parallel, ``w1`` ``[f, h]``) → ``linear_fc2`` (row-parallel, ``w2`` ``[h, f]``) →
    ``out_proj`` (TE-like linear replicated on every TP rank, ``w3`` ``[h, h]``), with or without sequence
    parallelism; each rank holds its shard of the TP=1 weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    f, h = w1.shape
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, tensor_model_parallel_size=world,
                            sequence_parallel=sp, use_cpu_initialization=True, gradient_accumulation_fusion=False)
    block = nn.Module()
    block.linear_fc1 = ColumnParallelLinear(h, f, config=cfg, init_method=nn.init.zeros_, bias=False,
                                            gather_output=False)
    block.linear_fc2 = RowParallelLinear(f, h, config=cfg, init_method=nn.init.zeros_, bias=False,
                                         input_is_parallel=True, skip_bias_add=True)
    block.out_proj = FakeTELinear(h, h)
    block.out_proj.config = cfg
    with torch.no_grad():
        block.linear_fc1.weight.copy_(w1.chunk(world, 0)[rank])
        block.linear_fc2.weight.copy_(w2.chunk(world, 1)[rank])
        block.out_proj.weight.copy_(w3)
    return block
