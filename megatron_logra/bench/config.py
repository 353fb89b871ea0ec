"""Typed configuration of ``megatron-logra bench paper``.

One dataclass holds every knob of the paper-figure benchmark so that the quick and the full
run differ only in numbers, never in code paths. ``PaperBenchConfig.preset(quick)`` gives the
two budgets (``--quick``: about 3 minutes on 2 cores, full: about 20); every field is checked
in ``__post_init__`` and a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = ["PaperBenchConfig", "OPTIMIZERS", "KL_MODES"]

OPTIMIZERS = ("logra", "adam", "galore", "apollo")
"""Optimizers the benchmark knows: LoGRA (the ``tiny`` recipe), dense AdamW (``tiny-adam``),
GaLore and APOLLO (``tiny-adam`` with the peer on the LoGRA target matrices)."""

KL_MODES = ("none", "k3", "predicted", "calibrated")
"""KL handling variants of LoGRA for Fig 6: no control (α = 1), a k3 penalty to the warm start
in the loss (α = 1), predicted-KL step control, predicted-KL with closed-loop calibration."""


def _positive_ints(name: str, values: list, *, allow_empty: bool = False) -> None:
    if not isinstance(values, (list, tuple)) or (not values and not allow_empty):
        raise ValueError(f"{name}={values!r} must be a non-empty list of integers >= 1")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={values!r}: every entry must be an integer >= 1 (got {v!r})")


@dataclass
class PaperBenchConfig:
    """What ``megatron-logra bench paper`` runs and where it writes."""

    quick: bool = False
    """Quick budget (fewer steps, one seed, smaller sizes); recorded in the report."""
    out_dir: str = "docs"
    """The report is written to ``out_dir/results.md`` and the PNGs to ``out_dir/results/``."""
    run_root: str = "runs/bench-paper"
    """Parent directory of the RL run directories (metrics.jsonl of every run stays there)."""
    figures: list[str] = field(default_factory=lambda: ["memory", "accuracy", "cosine", "kl"])
    """Which figure groups to produce: memory (Fig 1), accuracy (Fig 2, 5a), cosine (Fig 5b/5c), kl (Fig 6)."""
    optimizers: list[str] = field(default_factory=lambda: list(OPTIMIZERS))
    """Optimizers of Fig 1 and Fig 2 (subset of logra, adam, galore, apollo)."""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Training seeds of Fig 2 (``train.seed``; the held-out split is the warm start's and never changes)."""
    rl_steps: int = 50
    """RL updates per run."""
    eval_interval: int = 10
    """Held-out accuracy every this many updates (the x-axis points of Fig 2, 5a, 6)."""
    ranks: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    """LoGRA ranks of Fig 5a (each <= 128, the tiny model's smallest target input width)."""
    rank_seeds: list[int] = field(default_factory=lambda: [1])
    """Seeds of the rank sweep (the recipe's rank reuses Fig 2's runs of these seeds)."""
    kl_modes: list[str] = field(default_factory=lambda: list(KL_MODES))
    """KL handling variants of Fig 6 (subset of none, k3, predicted, calibrated)."""
    kl_seeds: list[int] = field(default_factory=lambda: [1])
    """Seeds of the KL variants (``calibrated`` is the recipe and reuses Fig 2's LoGRA runs)."""
    k3_coef: float = 0.1
    """Coefficient of the k3 KL penalty to the warm-start policy (``rl.loss.kl_coef``) in the k3 variant."""
    peer_update_proj_gap: int = 20
    """GaLore/APOLLO projector refresh interval in updates (their papers use 200 over thousands of steps)."""
    galore_scale: float = 1.0
    """GaLore's scale α on the projected-back update (1.0: the same effective lr as dense AdamW)."""
    apollo_scale: float = 1.0
    """APOLLO's scale on the channel-scaled gradient (1.0 at rank >= 32, as in its paper)."""
    memory_sizes: list[tuple[int, int]] = field(default_factory=lambda: [(256, 2), (512, 1), (768, 1)])
    """(hidden, layers) of the megatron GPTs measured in Fig 1 (heads = hidden/64, SwiGLU ffn ≈ 8/3·hidden).
    bf16 GEMMs are slow on CPUs without bf16 units: one hidden-1024 step took 37 s on the shared 2-core machine."""
    memory_seq: int = 256
    """Tokens per sequence of the Fig 1 training step."""
    memory_micro_batch: int = 2
    """Sequences per micro-batch of the Fig 1 training step."""
    memory_steps: int = 1
    """Timed training steps per (size, optimizer) after one warm-up step; one more step is memory-tracked."""
    memory_rank_divisor: int = 16
    """Rank of LoGRA/GaLore/APOLLO in Fig 1 is hidden / this (as benchmarks/optimizer_memory.py)."""
    planner_presets: list[str] = field(default_factory=lambda: ["qwen2.5-1.5b", "qwen2.5-7b", "27b"])
    """Memory-planner presets shown beside the measurements (per GPU, TP 8, rank 128, full recompute)."""
    cosine_rank: int = 32
    """Sketch rank of Fig 5b/5c (the tiny recipe's)."""
    cosine_steps: int = 8
    """k: batches accumulated for the accumulated-gradient cosine; the single-step cosine is averaged over them."""
    cosine_draws: int = 32
    """Further projections per gradient for the single-step Monte-Carlo mean compared with the theory."""
    cosine_batch: int = 64
    """Sequences per batch of the cosine measurement."""
    theory_tolerance: float = 0.05
    """Allowed relative gap between the measured single-step cosine and sqrt(r/(r+n_in))."""
    threads: int = 1
    """torch intra-op threads (the machine is shared; one keeps runs comparable)."""

    def __post_init__(self) -> None:
        if not isinstance(self.quick, bool):
            raise ValueError(f"quick={self.quick!r} must be a bool")
        for name in ("out_dir", "run_root"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a non-empty path")
        known = ("memory", "accuracy", "cosine", "kl")
        if not self.figures or any(f not in known for f in self.figures):
            raise ValueError(f"figures={self.figures!r}: choose a non-empty subset of {known}")
        if not self.optimizers or any(o not in OPTIMIZERS for o in self.optimizers):
            raise ValueError(f"optimizers={self.optimizers!r}: choose a non-empty subset of {OPTIMIZERS}")
        if not self.kl_modes or any(m not in KL_MODES for m in self.kl_modes):
            raise ValueError(f"kl_modes={self.kl_modes!r}: choose a non-empty subset of {KL_MODES}")
        _positive_ints("seeds", self.seeds)
        _positive_ints("rank_seeds", self.rank_seeds)
        _positive_ints("kl_seeds", self.kl_seeds)
        _positive_ints("ranks", self.ranks)
        for name in ("figures", "optimizers", "kl_modes", "seeds", "rank_seeds", "kl_seeds", "ranks"):
            values = list(getattr(self, name))
            repeated = sorted({v for v in values if values.count(v) > 1}, key=values.index)
            if repeated:  # a repeated seed would count one run twice in a mean ± sd, a repeated optimizer twice
                raise ValueError(f"{name}={values!r} names {', '.join(map(repr, repeated))} more than once: "
                                 f"give each once")
        if max(self.ranks) > 128:
            raise ValueError(f"ranks={self.ranks!r}: every rank must be <= 128 (the tiny model's hidden size)")
        for name in ("rl_steps", "eval_interval", "peer_update_proj_gap", "memory_seq", "memory_micro_batch",
                     "memory_steps", "memory_rank_divisor", "cosine_steps", "cosine_draws", "cosine_batch", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.eval_interval > self.rl_steps:
            raise ValueError(f"eval_interval={self.eval_interval} must be <= rl_steps={self.rl_steps}")
        if not isinstance(self.cosine_rank, int) or not 1 <= self.cosine_rank <= 128:
            raise ValueError(f"cosine_rank={self.cosine_rank!r} must be an integer in [1, 128]")
        for name in ("k3_coef", "galore_scale", "apollo_scale", "theory_tolerance"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")
        if not self.memory_sizes:
            raise ValueError("memory_sizes is empty; give at least one (hidden, layers) pair")
        for size in self.memory_sizes:
            if (not isinstance(size, (tuple, list)) or len(size) != 2
                    or any(not isinstance(v, int) or v < 1 for v in size) or size[0] % 64):
                raise ValueError(f"memory_sizes={self.memory_sizes!r}: each entry is (hidden, layers) with "
                                 f"hidden a multiple of 64 and layers >= 1 (got {size!r})")
            if size[0] // self.memory_rank_divisor < 1:
                raise ValueError(f"memory_rank_divisor={self.memory_rank_divisor} leaves rank 0 at hidden {size[0]}")
        if not self.planner_presets:
            raise ValueError("planner_presets is empty; name at least one preset (e.g. 27b)")

    @classmethod
    def preset(cls, quick: bool, **overrides) -> "PaperBenchConfig":
        """The quick (≈3 min on 2 cores) or full (≈20 min) budget, with ``overrides`` on top."""
        if quick:
            base = dict(quick=True, seeds=[1], rl_steps=20, eval_interval=5, ranks=[8, 32], rank_seeds=[1],
                        kl_seeds=[1], memory_sizes=[(64, 1), (128, 1), (256, 1)], memory_seq=128, memory_steps=1,
                        cosine_steps=4, cosine_draws=8, cosine_batch=32)
        else:
            base = dict(quick=False)
        base.update(overrides)
        return cls(**base)
