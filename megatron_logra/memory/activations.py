"""Activation and logit memory of one rank: Korthikanti et al. (2022) generalised to this model family.

The tensors autograd saves in one layer (Korthikanti's per-layer figures, the notation ``T``, ``B``, ``q``,
``kv``, ``f``, ``t``, ``r``, and both layer specs the trainer builds) are :mod:`megatron_logra.memory.saved_tensors`,
re-exported here. This module owns what a rank holds on top of that: the totals of a pipeline stage (in-flight
micro-batches, recompute, the unfused score buffers, the last stage's final norm) and the logits.

Stage totals: without recompute every layer of the stage stores its set; with full recompute
(megatron ``uniform``, one layer per checkpoint) each layer stores only its input ``B·T·h``
and one layer's set is alive while it is recomputed. 1F1B pipeline stage ``k`` of ``pp``
holds ``pp − k`` micro-batches in flight (assuming at least ``pp`` micro-batches per step).
Unfused attention adds megatron's global score buffer ``B·a·T·s/t`` once, and once the
working set of the layer computing its scores: the ``baddbmm`` output (``B``) and its fp32 upcast
for the softmax (4), ``(B + 4)·a·T·s/t`` (``LiveTensorTracker`` peak breakdown of a bf16 GPT's
forward: ``empty`` + ``baddbmm`` + ``_to_copy`` to fp32 of ``[b, a, s, s]`` alive with the saved
sets). The last stage adds the final norm's saved set (as a layer's norm) and its output
``B·T·h``, which the output layer saves unless it is frozen.

Logits (last stage), with the trainer's chunked log-probs (:mod:`megatron_logra.rl.logprobs`,
``chunk`` tokens at a time): the 16-bit output ``[T, V/t]`` saved for backward and its 16-bit
gradient (``2 + 2`` bytes per entry), plus a working set of two fp32 ``[chunk, V/t]`` buffers
(``8·chunk·V/t``). Without chunking (``chunk = 0``, or a chunk of at least ``T`` tokens) the same
code runs one chunk of the whole batch: the working set is ``8·T·V/t``, the logits and their gradient
the same ``4·T·V/t`` (no other fp32 copy of the logits exists).

The LM job (``loss="lm"``) computes megatron's ``vocab_parallel_cross_entropy`` over the whole
logits: the 16-bit output (``B`` bytes per entry) and one fp32 ``[T, V/t]`` buffer that the loss
upcasts into, turns into the softmax in place, saves for backward and turns into the gradient in
place, ``(B + 4)·T·V/t`` in all. Measured with ``LiveTensorTracker`` on megatron-core's
``vocab_parallel_cross_entropy(logits.float(), labels)`` forward and backward (bf16 logits,
T = 1024, V = 32000): a peak of 6.00 bytes per logit entry above the start, = B + 4 for B = 2.
"""

from __future__ import annotations

import logging
from typing import Collection

from megatron_logra.memory.count import ParamCounts
from megatron_logra.memory.saved_tensors import LayerActivations, _element_bytes, layer_activations, norm_saved_bytes
from megatron_logra.models.gpt import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["LayerActivations", "layer_activations", "norm_saved_bytes", "activation_bytes", "logit_bytes"]


def activation_bytes(model: ModelConfig, counts: ParamCounts, *, tp: int, pp: int, micro_batch: int, seq_len: int,
                     recompute: str = "none", attention: str = "unfused", rank: int = 0,
                     targets: Collection[str] = (), freeze_native: bool = False) -> int:
    """Saved activations of the pipeline stage ``counts.stage`` on one rank (bytes).

    ``targets``: the LoGRA target kinds (frozen, captured at ``rank``; an ``output_layer`` target on the
    last stage), empty for dense AdamW; ``freeze_native``: LoGRA's non-targets (norms, the other linears,
    the output layer or tied embedding) are frozen too."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute={recompute!r}: choose none or full")
    targets = tuple(targets)
    layer = layer_activations(model, tp=tp, micro_batch=micro_batch, seq_len=seq_len, attention=attention,
                              rank=rank, targets=targets, freeze_native=freeze_native)
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
        # the final norm's saved set, and its output where the output layer saves it (a trained weight)
        stored += norm_saved_bytes(model, T, h, attention=attention, trained=not freeze_native)
        output_frozen = "output_layer" in targets or freeze_native
        if not output_frozen:
            stored += B * T * h
        if "output_layer" in targets:  # an output_layer target's capture
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
    chunk = tokens if chunk_tokens <= 0 else min(chunk_tokens, tokens)  # 0: the whole batch is one chunk
    return 2 * _element_bytes(model) * tokens * vocab, 8 * chunk * vocab
