"""Saved activations of one transformer layer: the tensors autograd keeps for backward, per layer spec.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", give
``s·b·h·(34 + 5·a·s/h)`` bytes per layer and micro-batch for a GELU GPT with dropout and
16-bit activations, ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` under tensor parallelism without
sequence parallelism, and ``2·s·b·h`` per layer with full recompute. Here, with ``T = b·s``
tokens per micro-batch, ``B`` bytes per activation element (2 for 16-bit parameters),
``q = a·d`` query width, ``kv = g·d`` key/value width (``d`` the head dimension,
``model.kv_channels`` when set, as Qwen3's ``head_dim``, else ``h/a``), ``f`` the MLP width, ``t`` TP,
``r`` the LoGRA rank (0 for dense AdamW), the tensors autograd saves in one layer are listed below for
the two layer specs the trainer builds. ``attention="unfused"`` is megatron-core's local spec (what
``build_gpt`` builds with ``model.transformer_impl=local``: torch norms, megatron's
``DotProductAttention``); ``attention="flash"`` is the TransformerEngine spec (norms fused into
``linear_qkv`` / ``linear_fc1`` as TE ``LayerNormLinear``, TE's fused attention).

A *frozen* linear saves no input: a LoGRA target (``install_sketches`` freezes it; megatron-core runs
``linear_with_frozen_weight``, which saves only the weight; TE's ``Linear`` saves its input only for a
weight gradient), the output layer when it is a target or when ``freeze_native`` freezes it (with tied
embeddings, the embedding), and under ``freeze_native`` every linear that is not a target. Frozen norm
weights (``freeze_native``) spare the local RMSNorm one saved tensor (below).

Local spec (measured: ``saved_tensors_hooks`` over a whole megatron ``TransformerLayer`` on CPU,
``tests/unit/test_planner_layer_saved_tensors.py``, exact for every row):

* norms (replicated over TP), each of the two: torch ``RMSNorm`` with fp32 weights (the local spec's
  default; ``build_gpt`` casts only ``LayerNorm``) upcasts its input and saves the fp32 copy ``4·T·h``,
  the fp32 ``rsqrt`` ``4·T`` and, when its weight trains, the fp32 normalised input ``4·T·h`` (the
  16-bit input itself is not saved); a 16-bit ``LayerNorm`` saves its input ``B·T·h`` and the fp32
  mean and rstd ``8·T``. Each norm's output ``B·T·h`` is saved by the linear it feeds (``linear_qkv``,
  ``linear_fc1``) unless that linear is frozen;
* q/k norms (``qk_layernorm``, Qwen3), per-head norms over ``T·(a + g)/t`` rows of width ``d``:
  RMSNorm ``4·T·(q + kv)/t + 4·T·(a + g)/t`` (+ ``4·T·(q + kv)/t`` with trained weights), LayerNorm
  ``8·T·(a + g)/t`` (its input is a view of the fused QKV output, counted under attention);
* RoPE: the 16-bit cos and sin of ``[s, d]`` for q and for k, ``4·s·d·B`` (per layer, not per token);
* attention, unfused: ``q``, ``k`` and ``v`` as megatron's ``baddbmm`` / ``bmm`` save them, ``B·T·q/t``
  each when they are tensors of their own (q and k after RoPE or the q/k norm; k and v expanded from
  ``g`` to ``a`` heads under GQA), else views that keep the whole fused QKV output
  ``B·T·(q + 2kv)/t`` alive (MHA: ``v``; attention is ``5·B·T·q/t`` there, ``3·B·T·q/t`` under GQA);
  the fp32 softmax output and the 16-bit probabilities ``6·a·T·s/t``; the boolean causal mask
  megatron builds in each layer, ``s²`` bytes;
* attention-output projection input: ``B·T·q/t`` unless ``linear_proj`` is frozen;
* MLP: ``4·B·T·f/t`` (SwiGLU, megatron-core >= 0.16.1: ``silu(x_glu) * (x_linear + glu_linear_offset)``
  saves the ``2f``-wide fc1 output, the silu output and the offset sum) or ``B·T·f/t`` (GELU: the fc1
  output), plus the fc2 input ``B·T·f/t`` unless ``linear_fc2`` is frozen;
* LoGRA capture: ``n·B·T·r`` -- ``P = X·Aᵀ`` (``[T, r]``) of the ``n`` target linears of a layer (4 by
  default), also on row-parallel ranks; an ``output_layer`` target adds ``B·T·r`` once on the last stage;
* dropout masks, only when the probability is > 0: ``2·T·h`` (+ ``a·T·s/t`` for attention dropout).

On CUDA the local spec runs the same code (megatron's fusions are off in ``build_gpt``). torch's
``rms_norm`` does not dispatch to its fused kernel for a 16-bit input with fp32 weights on any device
("Cannot dispatch to fused implementation"), so the composite path above runs there too; one H200 step
(``tools/memory_stress.py``, benchmarks/results/gpu_h200.md) is planned within 0.1% with it.

TransformerEngine spec (from TE's ``LayerNormLinear`` / ``Linear`` / fused attention; not measured here):
each fused norm saves its input ``B·T·h``, its output ``B·T·h`` (``LayerNormLinear`` keeps it even for a
frozen weight) and ``4·T`` (RMSNorm) or ``8·T`` (LayerNorm) of statistics; attention
``B·T·(2q + 3kv)/t + 4·a·T/t`` (q, k after RoPE, the fused QKV output, v being a view of it, the fp32
log-sum-exp); the attention output ``B·T·q/t``, which the fused attention saves whether or not
``linear_proj`` trains; q/k norms their statistics; RoPE and the MLP as above; no ``s × s`` term.

For a GELU GPT with 16-bit LayerNorm, learned positions and dropout (f = 4h, q = h, MHA) the dense total
is Korthikanti's ``T·h·(10 + 24/t) + 7·a·T·s/t`` plus ``16·T + s²`` bytes (7 instead of 5 bytes per
score: megatron keeps the softmax output in fp32; the norms' fp32 statistics and the causal mask).

This module owns the per-layer accounting (what each layer saves, measured against megatron for the local
spec); the totals of a pipeline stage and the logits are :mod:`megatron_logra.memory.activations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from megatron_logra.memory.count import TARGET_KINDS
from megatron_logra.models.gpt import ModelConfig

__all__ = ["LayerActivations", "layer_activations", "norm_saved_bytes"]


@dataclass(frozen=True)
class LayerActivations:
    """Saved activation bytes of one transformer layer and one micro-batch on one TP rank."""

    norms: int
    """The two norms' saved tensors, and their outputs where the linear they feed saves them."""
    qk_norms: int
    """The q / k norms' saved tensors (``qk_layernorm``; 0 without)."""
    rope: int
    """RoPE's 16-bit cos / sin tables for q and k (0 with learned positions)."""
    attention: int
    """q / k / v as attention saves them, scores and probabilities (unfused) or q / k / v and LSE (flash)."""
    causal_mask: int
    """The boolean ``[s, s]`` causal mask megatron's unfused softmax builds in each layer (0 for flash)."""
    proj_input: int
    """Input of the attention output projection (0 when it is frozen and nothing else saves it)."""
    mlp: int
    """fc1 output, activation and offset sum (SwiGLU) or activation input (GELU), and the fc2 input unless
    ``linear_fc2`` is frozen."""
    capture: int
    """LoGRA's ``P = X·Aᵀ`` of the layer's target linears (0 for dense AdamW)."""
    dropout_masks: int
    """1-byte dropout masks (0 when dropout is off)."""

    @property
    def total(self) -> int:
        return (self.norms + self.qk_norms + self.rope + self.attention + self.causal_mask + self.proj_input
                + self.mlp + self.capture + self.dropout_masks)


def _element_bytes(model: ModelConfig) -> int:
    return 4 if model.params_dtype == "float32" else 2


def norm_saved_bytes(model: ModelConfig, rows: int, width: int, *, attention: str = "unfused",
                     trained: bool = True) -> int:
    """Bytes one norm over ``rows`` vectors of ``width`` elements saves for backward (its output excluded).

    Local spec (``attention="unfused"``): torch ``RMSNorm`` with fp32 weights saves the fp32 upcast input,
    the fp32 ``rsqrt`` per row and, when its weight is ``trained``, the fp32 normalised input; a
    ``LayerNorm`` in the model's dtype saves its input and the fp32 mean and rstd per row. TE spec
    (``flash``): the norm's input and its fp32 statistics (rstd; LayerNorm also the mean).
    """
    B = _element_bytes(model)
    if attention == "flash":
        return B * rows * width + (8 if model.normalization == "LayerNorm" else 4) * rows
    if model.normalization == "LayerNorm":
        return B * rows * width + 8 * rows
    return 4 * rows * width + 4 * rows + (4 * rows * width if trained else 0)


def layer_activations(model: ModelConfig, *, tp: int, micro_batch: int, seq_len: int, attention: str = "unfused",
                      rank: int = 0, targets: Collection[str] = (), freeze_native: bool = False) -> LayerActivations:
    """Saved bytes of one layer (see the module docstring).

    ``targets``: the layer's LoGRA target kinds (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
    ``linear_fc2``; others are ignored here), frozen and captured at ``rank``; empty for dense AdamW.
    ``freeze_native``: every non-target parameter is frozen too (``optimizer.native.freeze``): the norm
    weights and the linears that are not targets.
    """
    if attention not in ("unfused", "flash"):
        raise ValueError(f"attention={attention!r}: choose unfused or flash")
    captured = [k for k in TARGET_KINDS if k in set(targets)]
    frozen = set(TARGET_KINDS) if freeze_native else set(captured)  # freeze_native freezes the non-targets too
    B, t, s, h = _element_bytes(model), tp, seq_len, model.hidden_size
    T = micro_batch * s
    a = model.num_attention_heads
    g = model.num_query_groups or a
    d = model.head_dim  # kv_channels when set (Qwen3's head_dim), else h / a
    q, kv = a * d, g * d
    f = model.ffn_hidden_size
    rope = model.position_embedding_type == "rope"
    local = attention == "unfused"
    masks = 2 * T * h if model.hidden_dropout > 0 else 0
    one_norm = norm_saved_bytes(model, T, h, attention=attention, trained=not freeze_native)
    if local:  # each norm output is saved by the linear it feeds, unless that linear is frozen
        norms = 2 * one_norm + sum(B * T * h for kind in ("linear_qkv", "linear_fc1") if kind not in frozen)
    else:  # TE's LayerNormLinear keeps the norm output whether or not its weight trains
        norms = 2 * (one_norm + B * T * h)
    gqa = g != a
    qk_rows = T * (a + g) // t
    qk_norms = 0
    if model.qk_layernorm:
        if not local:
            qk_norms = norm_saved_bytes(model, qk_rows, d, attention="flash") - B * qk_rows * d  # input: a QKV view
        elif model.normalization == "LayerNorm":
            # the fp32 statistics; its inputs are q (a copy under GQA, else a view of the fused QKV output) and k
            # (a view), counted with attention below
            qk_norms = 8 * qk_rows + (B * T * q // t if gqa else 0)
        else:
            qk_norms = norm_saved_bytes(model, qk_rows, d, trained=not freeze_native)
    if local:
        # what baddbmm / bmm save: q and k of their own after RoPE or the q/k norm, and under GQA (megatron's
        # reshape copies q; k and v are expanded to a heads), else views that keep the fused QKV output alive
        q_own = rope or model.qk_layernorm or gqa
        k_own = rope or model.qk_layernorm or gqa
        v_own = gqa
        qkv_view = not (q_own and k_own and v_own) or (model.qk_layernorm and model.normalization == "LayerNorm")
        attn = (q_own + k_own + v_own) * B * T * q // t + (B * T * (q + 2 * kv) // t if qkv_view else 0)
        attn += 6 * a * T * s // t
        if model.attention_dropout > 0:
            masks += a * T * s // t
    else:
        attn = B * T * (2 * q + 3 * kv) // t + 4 * a * T // t
    mlp_own = (4 if model.swiglu else 1) * B * T * f // t
    return LayerActivations(
        norms=norms,
        qk_norms=qk_norms,
        rope=4 * s * d * B if rope else 0,
        attention=attn,
        causal_mask=s * s if local else 0,
        proj_input=B * T * q // t if not local or "linear_proj" not in frozen else 0,
        mlp=mlp_own + (B * T * f // t if "linear_fc2" not in frozen else 0),
        capture=len(captured) * B * T * rank,
        dropout_masks=masks,
    )
