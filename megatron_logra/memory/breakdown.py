"""The planner's answer: :class:`RankMemory` (bytes on one rank, line by line) and :class:`MemoryPlan`.

``RankMemory`` holds the byte counts the planner fills in and derives the peaks from them (trainer, policy
sync, rollout; the larger of forward/backward and optimizer temporaries, as they are never alive together);
``MemoryPlan`` holds one ``RankMemory`` per pipeline stage and judges the worst against the GPU. The
formulas behind each line are in :mod:`~megatron_logra.memory.planner` and ``docs/memory.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.memory.count import ParamCounts
from megatron_logra.memory.plan_config import PlanConfig
from megatron_logra.models.gpt import ModelConfig

__all__ = ["RankMemory", "MemoryPlan"]


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
    """Saved activations of the micro-batches in flight (see :mod:`~megatron_logra.memory.planner`)."""
    logits: int = 0
    """Output logits: 16-bit [T, V/tp] and its 16-bit gradient (last stage only)."""
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
