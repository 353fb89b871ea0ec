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
    log-prob working set ``8·chunk·V/t`` (unchunked: fp32 copy ``(2 + 4)·T·V/t``, ``8·T·V/t``);
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
import math
from dataclasses import dataclass, field, replace
from typing import Optional

from megatron_logra.memory.activations import activation_bytes, logit_bytes
from megatron_logra.memory.count import TARGET_KINDS, ParamCounts, count_params, resolve_targets
from megatron_logra.memory.units import GiB, parse_bytes
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.sync.sglang_payloads import DEFAULT_CHUNK_BYTES

logger = logging.getLogger(__name__)

__all__ = ["PlanConfig", "RankMemory", "MemoryPlan", "plan", "compare", "check_layout", "embedded_kv_cache_bytes"]

OPTIMIZERS = ("adam", "logra")


def _size_field(name: str, value, *, example: str) -> int:
    """Bytes of the ``PlanConfig`` size field ``name``: an int (not a bool), or a string with a unit read by
    :func:`~megatron_logra.memory.units.parse_bytes`; ``ValueError`` naming the field for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name}={value!r} must be a number of bytes (an int) or a size with a unit, e.g. {example}")
    return parse_bytes(value, name=name, require_unit=True)  # refuses negative, unit-less and too-large sizes


@dataclass
class PlanConfig:
    """A training configuration to plan: parallel layout, optimizer, batch shape, GPU."""

    tp: int = 1
    """Tensor-parallel size (must divide heads, query groups and the MLP width)."""
    pp: int = 1
    """Pipeline-parallel size (must divide the number of layers)."""
    dp: int = 1
    """Data-parallel size (only the distributed optimizer's sharding depends on it)."""
    optimizer: str = "logra"
    """adam (dense AdamW, Megatron mixed precision) or logra (sketches + RowAdam, native AdamW for the rest)."""
    rank: int = 256
    """LoGRA sketch rank r (1 <= r <= n_in of every target)."""
    masters: str = "fp32"
    """LoGRA masters: fp32 (4 B per 16-bit target parameter) or none (bf16-only)."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    seq_len: int = 4096
    """Tokens per sequence (prompt + response)."""
    recompute: str = "none"
    """Activation recompute: none or full (megatron uniform, one layer per checkpoint)."""
    gpu_memory_bytes: int = 80 * GiB
    """Memory of one GPU: bytes (an int), or a size with its unit such as ``"80GiB"`` (stored as bytes)."""
    engine_fraction: float = 0.0
    """Fraction of GPU memory held by a colocated rollout engine (SGLang mem_fraction_static), a number in
    [0, 1); 0 = none."""
    distributed_optimizer: bool = False
    """Plan Megatron-LM's DistributedOptimizer (masters and Adam moments of AdamW parameters sharded over DP,
    fused Adam, in-place reduce-scatter). This trainer does not implement it: False plans what it runs."""
    targets: tuple[str, ...] = TARGET_KINDS
    """LoGRA target layers (``optimizer.logra.targets``: megatron kinds, their HF aliases, output_layer)."""
    freeze_native: bool = False
    """LoGRA: non-target parameters are frozen (``optimizer.native.freeze``): no grads, masters or moments."""
    scaled_native_step: bool = True
    """LoGRA: a KL step-size controller scales the native AdamW step (RL with ``kl.mode`` other than none
    and ``logra.scale_native``, the defaults), which copies the fp32 masters during the step."""
    attention: str = "unfused"
    """unfused (megatron-core's local spec: torch norms, its DotProductAttention storing s x s scores) or flash
    (the TransformerEngine spec: norms fused into linear_qkv / linear_fc1, fused attention)."""
    cache_projections: bool = True
    """LoGRA keeps a step's fp32 projections from forward to apply (LograConfig.cache_projections)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the log-prob computation (rl.loss.logprob_chunk_tokens); 0 = whole batch at once."""
    loss: str = "logprob"
    """logprob (the RL job's chunked log-probs) or lm (the LM job: megatron's vocab-parallel cross entropy)."""
    policy_sync: bool = True
    """The run syncs its policy to a rollout engine after each step (RL); False = no policy-sync temporaries (LM)."""
    reference_model: bool = False
    """The run keeps a frozen reference model for a KL penalty (``rl.loss.kl_coef > 0``): a second copy of
    every rank's weights in their own dtypes (no gradients, no optimizer state)."""
    rollout_sequences: int = 0
    """Sequences an embedded rollout engine (``rl.rollout.engine=embedded``) generates at once on this GPU; its
    KV cache for that many ``seq_len``-token sequences is planned beside the persistent state. 0 = none (an
    SGLang engine's KV cache is part of ``engine_fraction``)."""
    overhead_bytes: int = 2 * GiB
    """CUDA context, NCCL buffers and allocator fragmentation per GPU: bytes (an int), or a size with its unit
    such as ``"2GiB"`` (stored as bytes)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "rank", "micro_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose adam or logra")
        if self.masters not in ("fp32", "none"):
            raise ValueError(f"masters={self.masters!r}: choose fp32 or none")
        if self.recompute not in ("none", "full"):
            raise ValueError(f"recompute={self.recompute!r}: choose none or full")
        if self.attention not in ("unfused", "flash"):
            raise ValueError(f"attention={self.attention!r}: choose unfused or flash")
        self.gpu_memory_bytes = _size_field("gpu_memory_bytes", self.gpu_memory_bytes, example="80 * 2**30 or '80GiB'")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes={self.gpu_memory_bytes!r} must be a positive number of bytes "
                             f"(e.g. 80 * 2**30 or '80GiB')")
        fraction = self.engine_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
            raise ValueError(f"engine_fraction={fraction!r} must be a number in [0, 1), e.g. 0.3 (0 = no colocated "
                             f"engine)")
        self.engine_fraction = float(fraction)
        if self.loss not in ("logprob", "lm"):
            raise ValueError(f"loss={self.loss!r}: choose logprob or lm")
        if isinstance(self.rollout_sequences, bool) or not isinstance(self.rollout_sequences, int) \
                or self.rollout_sequences < 0:
            raise ValueError(f"rollout_sequences={self.rollout_sequences!r} must be an integer >= 0 (0 = no embedded "
                             f"rollout engine)")
        if not isinstance(self.logprob_chunk_tokens, int) or self.logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens={self.logprob_chunk_tokens!r} must be an integer >= 0 (0 = unchunked)")
        self.overhead_bytes = _size_field("overhead_bytes", self.overhead_bytes, example="2 * 2**30 or '2GiB'")
        for name in ("distributed_optimizer", "freeze_native", "scaled_native_step", "cache_projections", "policy_sync",
                     "reference_model"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        self.targets = resolve_targets(self.targets)
        if self.freeze_native and self.optimizer != "logra":
            raise ValueError("freeze_native=True applies to LoGRA's non-target parameters; dense AdamW (optimizer=adam) "
                             "trains every parameter: set freeze_native=False")


@dataclass
class RankMemory:
    """Bytes on one rank of one pipeline stage."""

    stage: int
    """Pipeline stage (0 = first)."""
    counts: ParamCounts = field(repr=False)
    """Exact parameter counts of this rank."""
    weights: int = 0
    """All parameters in their own dtypes."""
    grads: int = 0
    """fp32 gradient buffers (dense: all parameters; LoGRA: non-targets only)."""
    masters: int = 0
    """fp32 master weights (dense: all 16-bit parameters; LoGRA: 16-bit targets + 16-bit non-targets)."""
    moments: int = 0
    """Adam first and second moments (fp32), of the parameters stepped by AdamW."""
    sketches: int = 0
    """LoGRA sketch buffer: fp32 [Σ n_out held by this rank, r]."""
    row_moments: int = 0
    """LoGRA RowAdam second moments: one fp32 per sketch row."""
    reference: int = 0
    """Frozen reference model of a KL penalty: this rank's weights once more."""
    target_persistent: int = 0
    """The part of the persistent state that belongs to target linears (weight, grad, master, moments or sketch state)."""
    projection_cache: int = 0
    """LoGRA cached fp32 projections of one step (forward to apply)."""
    projection_working: int = 0
    """LoGRA without the projection cache: the fp32 projections ``prepare()`` generates and holds (optimizer
    phase only)."""
    activations: int = 0
    """Saved activations of the micro-batches in flight (see the module docstring)."""
    logits: int = 0
    """Output logits: 16-bit [T, V/tp] and its gradient, or its fp32 copy when unchunked (last stage only)."""
    logprob_working: int = 0
    """Log-prob / cross-entropy working set: two more fp32 [T, V/tp] (last stage only)."""
    grad_working: int = 0
    """Gradient reduction / norm temporaries of the AdamW parameters: the flat DP all-reduce buffer (DP > 1)
    or the fp64 square of the largest gradient, whichever is larger."""
    adam_working: int = 0
    """AdamW step temporaries: foreach sqrt of the second moments (+ a copy of the masters for a scaled step)."""
    step_working: int = 0
    """LoGRA step temporaries: directions + the largest target's fp32 update (0 for dense AdamW)."""
    largest_update: int = 0
    """The part of ``step_working`` that is one target's fp32 update (freed before the native AdamW step)."""
    sync_working: int = 0
    """Policy-sync temporaries: a streamed dense refit (2 x the largest full parameter + one chunk)."""
    rollout_working: int = 0
    """An embedded rollout engine's KV cache at its largest (one ``generate()`` batch), during rollouts."""
    engine: int = 0
    """Colocated rollout engine's share of the GPU."""
    overhead: int = 0
    """CUDA context, NCCL buffers, allocator fragmentation."""

    @property
    def persistent(self) -> int:
        return self.weights + self.grads + self.masters + self.moments + self.sketches + self.row_moments + self.reference

    @property
    def forward_backward(self) -> int:
        return self.activations + self.logits + self.logprob_working

    @property
    def optimizer_working(self) -> int:
        """Temporaries after backward: gradient reduction / norm, then the step (LoGRA's directions stay alive
        through the native AdamW step; the target updates come first and free theirs). Uncached projections
        live through ``prepare()``: the grad norm and the directions, not the apply."""
        directions = self.step_working - self.largest_update
        prepare = self.projection_working + max(self.grad_working, directions)
        return max(self.grad_working, prepare, directions + max(self.largest_update, self.adam_working))

    @property
    def trainer_peak(self) -> int:
        """Persistent state + cached projections + the larger of forward/backward and optimizer temporaries."""
        return self.persistent + self.projection_cache + max(self.forward_backward, self.optimizer_working)

    @property
    def sync_peak(self) -> int:
        """Persistent state + policy-sync temporaries (the sync runs after the step's apply)."""
        return self.persistent + self.sync_working

    @property
    def rollout_peak(self) -> int:
        """Persistent state + an embedded engine's KV cache (rollouts run between steps)."""
        return self.persistent + self.rollout_working

    @property
    def total(self) -> int:
        return max(self.trainer_peak, self.sync_peak, self.rollout_peak) + self.engine + self.overhead

    def items(self) -> list[tuple[str, int]]:
        """(label, bytes) of every line, in display order."""
        return [
            ("weights", self.weights), ("grads (fp32)", self.grads), ("fp32 masters", self.masters),
            ("Adam moments", self.moments), ("sketches", self.sketches), ("row moments", self.row_moments),
            ("reference model", self.reference),
            ("projection cache", self.projection_cache), ("uncached projections (prepare)", self.projection_working),
            ("activations", self.activations),
            ("logits", self.logits), ("log-prob working set", self.logprob_working),
            ("grad reduce / norm temporaries", self.grad_working), ("AdamW step temporaries", self.adam_working),
            ("LoGRA step temporaries", self.step_working), ("policy-sync temporaries", self.sync_working),
            ("rollout engine", self.engine), ("embedded rollout KV cache", self.rollout_working),
            ("CUDA/NCCL overhead", self.overhead),
        ]


@dataclass
class MemoryPlan:
    """The plan of one configuration: every pipeline stage, the worst one and the verdict."""

    model: ModelConfig
    """The model planned."""
    config: PlanConfig
    """The configuration planned."""
    stages: tuple[RankMemory, ...]
    """One entry per pipeline stage (a rank of that stage)."""

    @property
    def worst(self) -> RankMemory:
        return max(self.stages, key=lambda r: r.total)

    @property
    def gpu_memory(self) -> int:
        return self.config.gpu_memory_bytes

    @property
    def headroom(self) -> float:
        """Free fraction of GPU memory on the worst rank (negative: short by that fraction)."""
        return (self.gpu_memory - self.worst.total) / self.gpu_memory

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.gpu_memory

    def engine_fraction_limit(self, min_headroom: float = 0.0) -> float:
        """Largest colocated-engine fraction that keeps ``min_headroom`` free on the worst rank (may be < 0)."""
        if not 0.0 <= min_headroom < 1.0:
            raise ValueError(f"min_headroom={min_headroom!r} must lie in [0, 1)")
        gpu = self.gpu_memory
        return min((gpu * (1.0 - min_headroom) - (r.total - r.engine)) / gpu for r in self.stages)

    @property
    def verdict(self) -> str:
        return f"{'fit' if self.fits else 'OOM'} ({100 * self.headroom:+.1f}% headroom)"


def _divisors_common(*values: int) -> list[int]:
    g = math.gcd(*values)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_split(model: ModelConfig, tp: int, pp: int, *, tp_name: str = "tp", pp_name: str = "pp") -> None:
    """Raise ``ValueError`` naming the fields when ``tp`` does not divide the attention heads, query groups and
    MLP width of ``model`` or ``pp`` its layers (megatron-core asserts these when it builds the model);
    ``tp_name`` / ``pp_name`` are how the message spells the sizes (``parallel.tp`` in a run config)."""
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    ok = _divisors_common(heads, groups, model.ffn_hidden_size)
    for what, value in (("num_attention_heads", heads), ("num_query_groups", groups), ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{tp_name}={tp} must divide model.{what}={value}: choose {tp_name} in {ok}")
    if model.num_layers % pp:
        ok_pp = [d for d in range(1, model.num_layers + 1) if model.num_layers % d == 0]
        raise ValueError(f"{pp_name}={pp} must divide model.num_layers={model.num_layers}: choose {pp_name} in "
                         f"{ok_pp}")


def check_layout(model: ModelConfig, cfg: PlanConfig) -> None:
    """Raise ``ValueError`` naming the field when the layout cannot shard ``model`` (:func:`check_split`,
    then the LoGRA targets and rank)."""
    heads = model.num_attention_heads
    check_split(model, cfg.tp, cfg.pp)
    if cfg.optimizer == "logra":
        if "output_layer" in cfg.targets and not model.untie_embeddings_and_output_weights:
            raise ValueError("targets: output_layer is the word embeddings of this model (tied embeddings); a tied "
                             "output layer cannot be a LoGRA target: untie the embeddings or drop output_layer "
                             "(optimizer.logra.targets)")
        # full input widths of the targets (as the trainer checks them): linear_qkv, linear_fc1 and output_layer
        # read h, linear_proj the attention output a x head_dim (head_dim = kv_channels when set), linear_fc2 the
        # MLP width
        widths = {"linear_qkv": model.hidden_size, "linear_proj": heads * model.head_dim,
                  "linear_fc1": model.hidden_size, "linear_fc2": model.ffn_hidden_size,
                  "output_layer": model.hidden_size}
        name, min_in = min(((k, widths[k]) for k in cfg.targets), key=lambda kv: kv[1])
        if cfg.rank > min_in:
            raise ValueError(f"rank={cfg.rank} must be <= the smallest target input width {min_in} ({name})")


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
    * while sampling (``rollout.embedded.sample_next``, its top-p path, the largest): the logits and their fp32
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
