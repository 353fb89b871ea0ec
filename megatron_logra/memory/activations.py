"""Activation and logit memory of one rank: Korthikanti et al. (2022) generalised to this model family.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", give
``s·b·h·(34 + 5·a·s/h)`` bytes per layer and micro-batch for a GELU GPT with dropout and
16-bit activations, ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` under tensor parallelism without
sequence parallelism, and ``2·s·b·h`` per layer with full recompute. Here, with ``T = b·s``
tokens per micro-batch, ``B`` bytes per activation element (2 for 16-bit parameters),
``q = a·d`` query width, ``kv = g·d`` key/value width (``d`` the head dimension,
``model.kv_channels`` when set, as Qwen3's ``head_dim``, else ``h/a``), ``f`` the MLP width, ``t`` TP,
``r`` the LoGRA rank (0 for dense AdamW), and megatron-core's local spec (what
``build_gpt`` builds), the saved tensors of one layer are:

* norms (replicated over TP): ``4·B·T·h`` — inputs and outputs of both norms (outputs feed QKV, fc1);
* attention, unfused: ``3·B·T·q/t + 6·a·T·s/t`` — q, and k, v after megatron's GQA expansion; the fp32
  softmax output and the 16-bit probabilities;
* attention, flash: ``B·T·(2q + 3kv)/t + 4·a·T/t`` — q, k after RoPE, the fused QKV output (v is a view
  of it), the fp32 log-sum-exp;
* attention-output projection input: ``B·T·q/t``;
* MLP: ``5·B·T·f/t`` (SwiGLU, megatron-core >= 0.16.1: ``silu(x_glu) * (x_linear + glu_linear_offset)``
  saves the ``2f``-wide fc1 output, the silu output, the offset sum ``x_linear + offset`` and the
  product; measured with ``saved_tensors_hooks`` on megatron's MLP) or ``2·B·T·f/t`` (GELU);
* LoGRA capture: ``n·B·T·r`` — ``P = X·Aᵀ`` (``[T, r]``) of the ``n`` target linears of a layer (4 by
  default), also on row-parallel ranks; an ``output_layer`` target adds ``B·T·r`` once on the last stage;
* dropout masks, only when the probability is > 0: ``2·T·h`` (+ ``a·T·s/t`` for attention dropout).

For the GELU GPT with dropout (f = 4h, q = h) the dense total is Korthikanti's
``T·h·(10 + 24/t) + 7·a·T·s/t`` (7 instead of 5 bytes per score: megatron keeps the softmax
output in fp32).
Stage totals: without recompute every layer of the stage stores its set; with full recompute
(megatron ``uniform``, one layer per checkpoint) each layer stores only its input ``B·T·h``
and one layer's set is alive while it is recomputed. 1F1B pipeline stage ``k`` of ``pp``
holds ``pp − k`` micro-batches in flight (assuming at least ``pp`` micro-batches per step).
Unfused attention adds megatron's global score buffer ``B·a·T·s/t`` once, and once the
working set of the layer computing its scores: the ``baddbmm`` output (``B``) and its fp32 upcast
for the softmax (4), ``(B + 4)·a·T·s/t`` (``LiveTensorTracker`` peak breakdown of a bf16 GPT's
forward: ``empty`` + ``baddbmm`` + ``_to_copy`` to fp32 of ``[b, a, s, s]`` alive with the saved
sets). The last stage adds the final norm's input and output ``2·B·T·h``.

Logits (last stage), with the trainer's chunked log-probs (:mod:`megatron_logra.rl.logprobs`,
``chunk`` tokens at a time): the 16-bit output ``[T, V/t]`` saved for backward and its 16-bit
gradient (``2 + 2`` bytes per entry), plus a working set of two fp32 ``[chunk, V/t]`` buffers
(``8·chunk·V/t``). Without chunking (``chunk = 0``) the whole batch is upcast: an fp32 copy of
the logits (``2 + 4`` bytes per entry) and a working set of ``8·T·V/t``.

The LM job (``loss="lm"``) computes megatron's ``vocab_parallel_cross_entropy`` over the whole
logits: the 16-bit output (``B`` bytes per entry) and one fp32 ``[T, V/t]`` buffer that the loss
upcasts into, turns into the softmax in place, saves for backward and turns into the gradient in
place, ``(B + 4)·T·V/t`` in all. Measured with ``LiveTensorTracker`` on megatron-core's
``vocab_parallel_cross_entropy(logits.float(), labels)`` forward and backward (bf16 logits,
T = 1024, V = 32000): a peak of 6.00 bytes per logit entry above the start, = B + 4 for B = 2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatron_logra.memory.count import ParamCounts
from megatron_logra.models.gpt import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["LayerActivations", "layer_activations", "activation_bytes", "logit_bytes"]


@dataclass(frozen=True)
class LayerActivations:
    """Saved activation bytes of one transformer layer and one micro-batch on one TP rank."""

    norms: int
    """Norm inputs and outputs (replicated over TP)."""
    attention: int
    """q / k / v, scores and probabilities (unfused) or q / k / v and LSE (flash)."""
    proj_input: int
    """Input of the attention output projection."""
    mlp: int
    """fc1 output, activation, offset sum and gated product (SwiGLU) or activation input/output (GELU)."""
    capture: int
    """LoGRA's ``P = X·Aᵀ`` of the layer's target linears (0 for dense AdamW)."""
    dropout_masks: int
    """1-byte dropout masks (0 when dropout is off)."""

    @property
    def total(self) -> int:
        return self.norms + self.attention + self.proj_input + self.mlp + self.capture + self.dropout_masks


def _element_bytes(model: ModelConfig) -> int:
    return 4 if model.params_dtype == "float32" else 2


def layer_activations(model: ModelConfig, *, tp: int, micro_batch: int, seq_len: int, attention: str = "unfused",
                      rank: int = 0, num_targets: int = 4) -> LayerActivations:
    """Saved bytes of one layer (see the table in the module docstring)."""
    if attention not in ("unfused", "flash"):
        raise ValueError(f"attention={attention!r}: choose unfused or flash")
    B, t, s, h = _element_bytes(model), tp, seq_len, model.hidden_size
    T = micro_batch * s
    a = model.num_attention_heads
    d = model.head_dim  # kv_channels when set (Qwen3's head_dim), else h / a
    q, kv = a * d, (model.num_query_groups or a) * d
    f = model.ffn_hidden_size
    masks = 2 * T * h if model.hidden_dropout > 0 else 0
    if attention == "unfused":
        attn = 3 * B * T * q // t + 6 * a * T * s // t
        if model.attention_dropout > 0:
            masks += a * T * s // t
    else:
        attn = B * T * (2 * q + 3 * kv) // t + 4 * a * T // t
    return LayerActivations(
        norms=4 * B * T * h,
        attention=attn,
        proj_input=B * T * q // t,
        mlp=(5 if model.swiglu else 2) * B * T * f // t,
        capture=num_targets * B * T * rank,
        dropout_masks=masks,
    )


def activation_bytes(model: ModelConfig, counts: ParamCounts, *, tp: int, pp: int, micro_batch: int, seq_len: int,
                     recompute: str = "none", attention: str = "unfused", rank: int = 0) -> int:
    """Saved activations of the pipeline stage ``counts.stage`` on one rank (bytes)."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute={recompute!r}: choose none or full")
    layer_targets = [t for t in counts.targets if t.kind != "output_layer"]
    layer = layer_activations(model, tp=tp, micro_batch=micro_batch, seq_len=seq_len, attention=attention,
                              rank=rank, num_targets=len(layer_targets))
    B, T, h = _element_bytes(model), micro_batch * seq_len, model.hidden_size
    in_flight = pp - counts.stage
    if recompute == "full":
        stored = in_flight * counts.num_layers * B * T * h + layer.total
    else:
        stored = in_flight * counts.num_layers * layer.total
    if attention == "unfused":
        # megatron's global score buffer, plus the scoring layer's baddbmm output and fp32 softmax input
        stored += (B + (B + 4)) * model.num_attention_heads * T * seq_len // tp
    if counts.stage == pp - 1:
        stored += 2 * B * T * h
        if len(layer_targets) < len(counts.targets):  # an output_layer target's capture
            stored += B * T * rank
    return stored


def logit_bytes(model: ModelConfig, counts: ParamCounts, *, tp: int, micro_batch: int, seq_len: int,
                chunk_tokens: int = 1024, loss: str = "logprob") -> tuple[int, int]:
    """(logits, log-prob / cross-entropy working set) bytes on the last stage (see the module docstring).

    ``loss``: ``logprob`` (the RL job's log-probs, ``chunk_tokens`` at a time) or ``lm`` (the LM job's
    cross entropy over the whole logits; ``chunk_tokens`` does not apply).
    """
    vocab = counts.padded_vocab // tp
    tokens = micro_batch * seq_len
    if loss == "lm":
        return _element_bytes(model) * tokens * vocab, 4 * tokens * vocab
    if loss != "logprob":
        raise ValueError(f"loss={loss!r}: choose logprob or lm")
    if chunk_tokens <= 0 or chunk_tokens >= tokens:
        return (_element_bytes(model) + 4) * tokens * vocab, 8 * tokens * vocab
    return 2 * _element_bytes(model) * tokens * vocab, 8 * chunk_tokens * vocab
