"""What the memory planner plans: :class:`PlanConfig`, one training configuration, checked on construction.

Every field is validated when the config is built (``ValueError`` naming the field and what it accepts), so
the arithmetic in :mod:`~megatron_logra.memory.planner` never sees a malformed value; sizes are bytes, given
as ints or as strings with a unit (``"80GiB"``, :func:`~megatron_logra.memory.units.parse_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.count import TARGET_KINDS, resolve_targets
from megatron_logra.memory.units import GiB, parse_bytes

__all__ = ["OPTIMIZERS", "PlanConfig"]

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
        if isinstance(self.logprob_chunk_tokens, bool) or not isinstance(self.logprob_chunk_tokens, int) \
                or self.logprob_chunk_tokens < 0:
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
