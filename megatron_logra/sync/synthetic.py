"""Model shapes and random sketch deltas for tests and benchmarks (no weights, no downloads).

:class:`DenseShape` describes a Llama/Qwen-style decoder (GQA attention, SwiGLU MLP) and
lists its LoGRA targets in canonical form and its Hugging Face parameter shapes;
:func:`random_delta` draws a well-formed :class:`SketchDelta` for it. Imports only torch
and the sync package.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.sync.factors import quantize_factor
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor, expected_layout

logger = logging.getLogger(__name__)

__all__ = ["DenseShape", "random_delta"]


@dataclass(frozen=True)
class DenseShape:
    """Shape of a decoder-only model: ``hidden``, ``layers``, ``heads``, ``kv_heads``, ``ffn``, ``vocab``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: Optional[int] = None
    tied: bool = False
    qkv_bias: bool = False

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attention(self) -> AttentionDims:
        return AttentionDims(self.heads, self.kv_heads, self.d)

    def targets(self) -> list[tuple[str, int, int]]:
        """``(canonical name, n_out, n_in)`` of the four targets of every layer."""
        out = []
        q, kv = self.heads * self.d, self.kv_heads * self.d
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "self_attn.qkv_proj", q + 2 * kv, self.hidden),
                (p + "self_attn.o_proj", self.hidden, q),
                (p + "mlp.gate_up_proj", 2 * self.ffn, self.hidden),
                (p + "mlp.down_proj", self.hidden, self.ffn),
            ]
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face parameter names and shapes (tied head excluded)."""
        h, q, kv, f = self.hidden, self.heads * self.d, self.kv_heads * self.d, self.ffn
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
            })
            if self.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
        out["model.norm.weight"] = (h,)
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        return out

    def num_params(self) -> int:
        total = 0
        for shape in self.hf_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def target_params(self) -> int:
        return sum(o * i for _, o, i in self.targets())


def random_delta(
    shape: DenseShape,
    rank: int,
    *,
    base_version: int = 0,
    new_version: int = 1,
    seed: int = 0,
    update_index: int = 0,
    step: Optional[int] = None,
    distribution: str = "rademacher",
    scale: float = 1e-3,
    dense: Optional[dict[str, torch.Tensor]] = None,
    generator_seed: int = 0,
    layers: Optional[list[int]] = None,
    rounding: str = "nearest",
) -> SketchDelta:
    """A well-formed delta with N(0, scale²) factors (``quantize_factor``) for every target (of ``layers``, default all);
    ``step`` defaults to ``new_version``; ``rounding``: how the merge rounds bf16 weights."""
    gen = torch.Generator().manual_seed(generator_seed)
    targets = []
    for name, n_out, n_in in shape.targets():
        if layers is not None and int(name.split(".")[2]) not in layers:
            continue
        U_OR = quantize_factor(torch.randn(n_out, rank, generator=gen) * scale)
        targets.append(TargetFactor(name=name, U_OR=U_OR, n_in=n_in, layout=expected_layout(name)))
    return SketchDelta(
        base_version=base_version, new_version=new_version, seed=seed, update_index=update_index,
        step=new_version if step is None else step, rank=rank, distribution=distribution, targets=targets,
        dense=dict(dense or {}), attention=shape.attention, rounding=rounding,
    )
