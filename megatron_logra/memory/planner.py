"""Per-rank GPU memory of one training configuration: pure arithmetic on exact parameter counts.

Every figure is bytes on one rank (one TP rank of one pipeline stage; data-parallel ranks
are alike). Parameter counts come from :func:`megatron_logra.memory.count.count_params`
(the megatron model built on the meta device). The formulas, all stated in ``docs/memory.md``:

Persistent state (lives across steps)
  * weights: every parameter in its own dtype (bf16 linears/embeddings, fp32 local-spec norms).
  * dense AdamW (Megatron mixed precision): fp32 grad buffer 4 B for every parameter (never
    sharded; Megatron's distributed optimizer reduce-scatters into the full buffer), fp32
    master 4 B for every 16-bit parameter, moments 2 x 4 B: 18 B/param, the same on every DP
    rank, as this trainer keeps them. ``distributed_optimizer`` plans Megatron-LM's
    DistributedOptimizer instead (not implemented by this trainer), which shards masters and
    moments over DP: 2 + 4 + 12/dp B/param (Megatron's table).
  * LoGRA: targets (``targets``, default the four layer linears) keep no gradient and no moments;
    an fp32 master (4 B) per 16-bit target parameter with ``masters="fp32"`` (replicated over DP:
    never sharded in this project); sketches ``4 r`` B per output row held by the rank
    (column-parallel targets hold n_out/tp rows, row-parallel ones all n_out rows as TP-partial
    sums); row moments 4 B per row. Non-target parameters (embedding, output layer, norms,
    biases) use the dense AdamW accounting above, sharded alike under ``distributed_optimizer``;
    with ``freeze_native`` (``optimizer.native.freeze``) they have no gradient, master or moments.

Transient state of a step (formulas in :mod:`megatron_logra.memory.activations`)
  * activations: saved activations of the micro-batches in flight.
  * logits (last stage): 16-bit output + its 16-bit gradient ``(2 + 2)·T·V/t``; chunked
    log-prob working set ``8·chunk·V/t`` (unchunked: one chunk of all ``T`` tokens, ``8·T·V/t``);
    LM job (``loss="lm"``, megatron's vocab-parallel cross entropy): ``(B + 4)·T·V/t``.
  * gradient reduction and norm (after backward, before the step; parameters stepped by AdamW,
    ``N`` of them): at DP > 1 the data-parallel all-reduce copies every fp32 gradient into one
    flat buffer, ``4·N``; the global grad norm squares each gradient in fp64, ``16`` B per element
    of the largest one. The larger of the two.
  * AdamW step: the trainer's ``torch.optim.AdamW`` runs torch's default implementation, which
    is *foreach* on CUDA; it allocates the square roots of all second moments of a parameter
    group at once, ``4·N`` (an upper bound when weight decay puts the 1-D parameters in a second
    group). A scaled native step (LoGRA under a KL step-size controller with
    ``logra.scale_native``: ``scaled_native_step``) also copies the fp32 masters, ``4·N`` more.
    With ``distributed_optimizer`` (Megatron's fused Adam on a contiguous buffer) neither the
    flat copy nor these temporaries exist.
  * LoGRA step: cached projections ``4·r·Σn_in`` (from forward to apply, when
    ``cache_projections``), directions ``4·r·Σn_out`` and the largest target's fp32 update; the
    directions stay alive through the native AdamW step that follows the target updates. Without the
    cache ``prepare()`` still generates every target's fp32 projection and keeps them all through the
    grad norm, the directions and the paper recipe's scaling: ``4·r·Σn_in`` during ``prepare()`` only.

Policy sync (after each step; RL only, ``policy_sync``)
  * the dense refit streams one full parameter at a time (``rl.weights``): the TP all-gather
    holds the shards and their concatenation, ``2·`` the largest full parameter, plus one
    refit chunk (``sync.sglang_payloads.DEFAULT_CHUNK_BYTES``) queued for the engine. Drift
    checks gather only sampled rows and deltas are ``[n_out, r]``: both negligible.

Colocated rollout engine: ``engine_fraction`` x GPU memory (SGLang's ``mem_fraction_static``:
engine weights + KV cache), resident during training. An embedded engine (a transformers copy of the
model on the trainer's GPU; its weights are the ``engine_fraction``) also grows a KV cache while it
generates, beside the trainer's persistent state: ``rollout_sequences`` sequences of up to ``seq_len``
tokens, every layer's keys and values, ``2·L·g·d·B`` bytes per token, plus one layer's keys copied as the
cache grows (transformers' ``DynamicCache`` concatenates) or the sampler's working set over the vocabulary,
whichever is larger (:func:`embedded_kv_cache_bytes`): the *rollout peak*. ``overhead_bytes`` covers the CUDA
context, NCCL buffers and allocator fragmentation.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

from megatron_logra.memory.activations import activation_bytes, logit_bytes
from megatron_logra.memory.breakdown import MemoryPlan, RankMemory
from megatron_logra.memory.count import count_params
from megatron_logra.memory.layout import check_layout
from megatron_logra.memory.plan_config import PlanConfig
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.sync.sglang_payloads import DEFAULT_CHUNK_BYTES

logger = logging.getLogger(__name__)

__all__ = ["plan", "compare", "embedded_kv_cache_bytes"]


def _stage(model: ModelConfig, cfg: PlanConfig, stage: int) -> RankMemory:
    c = count_params(model, tp=cfg.tp, pp=cfg.pp, stage=stage, targets=cfg.targets)
    shard = cfg.dp if cfg.distributed_optimizer else 1
    r = RankMemory(stage=stage, counts=c, weights=c.weight_bytes, reference=c.weight_bytes if cfg.reference_model else 0)
    target_weight_bytes = sum(t.numel * (2 if t.low_precision else 4) for t in c.targets)
    if cfg.optimizer == "adam":
        low = c.native_low_precision + c.target_low_precision
        r.grads = 4 * c.total
        r.masters = 4 * low // shard
        r.moments = 8 * c.total // shard
        r.target_persistent = target_weight_bytes + (4 * c.target_params + (4 * c.target_low_precision + 8 * c.target_params) // shard)
        adam_params, adam_largest, scaled = c.total, c.largest_param, False  # dense steps are never scaled
    else:
        target_masters = 4 * c.target_low_precision if cfg.masters == "fp32" else 0
        native, native_low = (0, 0) if cfg.freeze_native else (c.native, c.native_low_precision)
        r.grads = 4 * native
        r.masters = target_masters + 4 * native_low // shard
        r.moments = 8 * native // shard
        r.sketches = 4 * cfg.rank * c.target_rows
        r.row_moments = 4 * c.target_rows
        r.target_persistent = target_weight_bytes + target_masters + r.sketches + r.row_moments
        r.projection_cache = 4 * cfg.rank * c.target_cols if cfg.cache_projections else 0
        r.projection_working = 0 if cfg.cache_projections else 4 * cfg.rank * c.target_cols
        r.largest_update = 4 * c.largest_target
        r.step_working = 4 * cfg.rank * c.target_rows + r.largest_update
        adam_params = native
        adam_largest = 0 if cfg.freeze_native else c.largest_native
        scaled = cfg.scaled_native_step
    if not cfg.distributed_optimizer and adam_params:
        # the trainer's NativeAdamW (optim/native.py): one flat fp32 copy of all grads for the DP all-reduce,
        # g.double().pow(2) per gradient for the global norm, torch's foreach AdamW (CUDA default): sqrt of
        # every second moment; a scaled step keeps a copy of the fp32 masters through it
        r.grad_working = max(4 * adam_params if cfg.dp > 1 else 0, 16 * adam_largest)
        r.adam_working = 4 * adam_params + (4 * adam_params if scaled else 0)
    last = stage == cfg.pp - 1
    r.activations = activation_bytes(model, c, tp=cfg.tp, pp=cfg.pp, micro_batch=cfg.micro_batch, seq_len=cfg.seq_len,
                                     recompute=cfg.recompute, attention=cfg.attention,
                                     rank=cfg.rank if cfg.optimizer == "logra" else 0,
                                     targets=cfg.targets if cfg.optimizer == "logra" else (),
                                     freeze_native=cfg.freeze_native)
    if last:
        r.logits, r.logprob_working = logit_bytes(model, c, tp=cfg.tp, micro_batch=cfg.micro_batch, seq_len=cfg.seq_len,
                                                     chunk_tokens=cfg.logprob_chunk_tokens, loss=cfg.loss)
    if cfg.policy_sync:
        largest = max(count_params(model, tp=cfg.tp, pp=cfg.pp, stage=s).largest_full_bytes for s in {0, cfg.pp - 1})
        r.sync_working = 2 * largest + DEFAULT_CHUNK_BYTES  # every rank streams every stage's parameters
    r.engine = int(cfg.engine_fraction * cfg.gpu_memory_bytes)
    r.rollout_working = embedded_kv_cache_bytes(model, cfg.rollout_sequences, cfg.seq_len, tp=cfg.tp)
    r.overhead = cfg.overhead_bytes
    return r


def embedded_kv_cache_bytes(model: ModelConfig, sequences: int, seq_len: int, *, tp: int = 1) -> int:
    """Peak bytes of an embedded (transformers) engine generating ``sequences`` sequences of up to ``seq_len``
    tokens with the whole ``model`` in its dtype (weights excluded): the KV cache, keys and values of every
    layer, ``g·d`` wide each, ``2·L`` layer-sized tensors at the end, plus the larger of

    * while ``DynamicCache`` concatenates a token onto a layer: one layer's keys more, and the previous step's
      logits over the vocabulary (padded for the trainer's ``tp``) and their fp32 copy (``(B + 4)·V`` per
      sequence; ``4·V`` in fp32, where the copy is the same tensor);
    * while sampling (``rollout.sampling.sample_next``, its top-p path, the largest): the logits and their fp32
      copy, the log-softmax, the sorted values and their int64 order, the probabilities, the nucleus mask and
      the nucleus, ``(B + 4 + 29)·V`` per sequence (``33·V`` in fp32); plain sampling takes ``(B + 12)·V``;

    and the generation's per-token state (sampled tokens and attention mask in int64, log-probs in fp32:
    20 bytes per token). Measured on CPU with ``LiveTensorTracker`` (``tests/unit/test_planner_embedded_rollout.py``).
    """
    if not sequences:
        return 0
    B = 4 if model.params_dtype == "float32" else 2
    per_layer = sequences * seq_len * (model.num_query_groups or model.num_attention_heads) * model.head_dim * B
    vocab = sequences * model.padded_vocab_size(tp)
    copy = 0 if B == 4 else 4  # the fp32 copy of 16-bit logits
    growth = per_layer + (B + copy) * vocab
    sampling = (B + copy + 29) * vocab
    return 2 * model.num_layers * per_layer + max(growth, sampling) + 20 * sequences * seq_len


def plan(model: ModelConfig, config: Optional[PlanConfig] = None, **kwargs) -> MemoryPlan:
    """Plan ``model`` under ``config`` (or a ``PlanConfig`` built from ``kwargs``: tp, pp, dp,
    optimizer, rank, masters, micro_batch, seq_len, recompute, gpu_memory_bytes,
    engine_fraction, distributed_optimizer, targets, freeze_native, scaled_native_step, attention,
    cache_projections, logprob_chunk_tokens, loss, policy_sync, reference_model, rollout_sequences, overhead_bytes)."""
    if config is None:
        config = PlanConfig(**kwargs)
    elif kwargs:
        raise ValueError(f"give either config or keyword fields, not both (got {sorted(kwargs)})")
    check_layout(model, config)
    stages = tuple(_stage(model, config, k) for k in range(config.pp))
    result = MemoryPlan(model=model, config=config, stages=stages)
    logger.debug("plan %s tp=%d pp=%d dp=%d: %s", config.optimizer, config.tp, config.pp, config.dp, result.verdict)
    return result


def compare(model: ModelConfig, config: PlanConfig) -> tuple[MemoryPlan, MemoryPlan]:
    """(dense AdamW plan, LoGRA plan) of the same layout, batch and GPU (dense AdamW trains every parameter:
    ``freeze_native`` applies to the LoGRA plan only)."""
    return (plan(model, replace(config, optimizer="adam", freeze_native=False)),
            plan(model, replace(config, optimizer="logra")))
