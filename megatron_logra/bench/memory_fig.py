"""Fig 1: training memory of dense AdamW, LoGRA, GaLore and APOLLO.

Measured: megatron-core GPTs of a few sizes on this CPU (bf16 weights, rank = hidden /
``memory_rank_divisor``). After a warm-up step and ``memory_steps`` timed steps, one full
training step (zero_grad, forward, backward, prepare, apply) of one micro-batch is tracked,
with every live tensor storage counted by a ``TorchDispatchMode``
(``megatron_logra.memory.measure.LiveTensorTracker``, as in ``benchmarks/optimizer_memory.py``). Peak is the largest live
total during the tracked step; average is the mean live total over all ops of that step
(what the step holds most of the time, not only at its worst moment).

Planned: the memory planner's per-GPU totals at 1.5B/7B/27B (the largest TP <= 8 the heads allow, rank 128,
full recompute, 80 GiB), dense AdamW and LoGRA straight from :func:`megatron_logra.memory.compare`. GaLore
and APOLLO are not planner optimizers; their figures are derived from the dense plan by
replacing the target matrices' Adam moments (8 B/param) with rank-r moments and a projector,
which is how those methods store state (their dense fp32 gradient stays).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.peers import PeerSettings, peer_factory, peer_missing
from megatron_logra.memory.measure import LiveTensorTracker
from megatron_logra.metrics import elapsed
from megatron_logra.plot import pyplot, save_figure

logger = logging.getLogger(__name__)

__all__ = ["MemoryRow", "measure_memory", "planner_rows", "plot_memory"]

MiB = 1024.0 * 1024.0


@dataclass
class MemoryRow:
    """One (model size, optimizer) measurement."""

    hidden: int
    layers: int
    optimizer: str
    params: int = 0
    """All parameters of the model."""
    rank: int = 0
    start_bytes: int = 0
    """Live tensor bytes when the tracked step starts (weights + optimizer state)."""
    peak_bytes: int = 0
    avg_bytes: int = 0
    step_seconds: float = 0.0
    skipped: Optional[str] = None
    """Why this optimizer did not run (missing peer)."""


def _ffn(hidden: int) -> int:
    return max(64, (8 * hidden // 3) // 64 * 64)


def _build(cfg: PaperBenchConfig, hidden: int, layers: int, optimizer: str, groups):
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer

    rank = max(1, hidden // cfg.memory_rank_divisor)
    mcfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                       ffn_hidden_size=_ffn(hidden), vocab_size=1024, seq_length=cfg.memory_seq,
                       params_dtype="bfloat16", swiglu=True)
    model = build_gpt(mcfg, groups, seed=1)
    native = NativeConfig(lr=1e-4)
    if optimizer == "logra":
        opt = build_optimizer(model, OptimizerConfig(name="logra", logra=LograConfig(rank=rank, lr=1e-4),
                                                     native=native), groups)
    elif optimizer == "adam":
        opt = build_optimizer(model, OptimizerConfig(name="adam", native=native), groups)
    else:
        scale = cfg.galore_scale if optimizer == "galore" else cfg.apollo_scale
        factory = peer_factory(optimizer, PeerSettings(rank=rank, update_proj_gap=cfg.peer_update_proj_gap, scale=scale))
        opt = factory(model, OptimizerConfig(name="adam", native=native), groups)
    return model, opt, rank


def _measure_one(cfg: PaperBenchConfig, hidden: int, layers: int, optimizer: str, groups) -> MemoryRow:
    from megatron_logra.train.step import Batch, forward_backward

    row = MemoryRow(hidden=hidden, layers=layers, optimizer=optimizer)
    model, opt, row.rank = _build(cfg, hidden, layers, optimizer, groups)
    row.params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1234)
    b, s = cfg.memory_micro_batch, cfg.memory_seq
    tokens = torch.randint(0, 1024, (b, s), generator=gen)
    batch = Batch(tokens, torch.roll(tokens, -1, dims=1), torch.ones(b, s),
                  torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous())

    def step() -> None:
        opt.zero_grad()
        res = forward_backward(model, [batch], groups)
        update = opt.prepare(num_tokens=res.num_tokens)
        if update.skipped:
            raise RuntimeError(f"{optimizer}: step skipped ({update.reason})")
        opt.apply(update)

    step()  # warm-up: optimizer state exists from here on, as in any step but the first
    device = next(model.parameters()).device  # build_gpt puts the model on the GPU where there is one
    elapsed(time.perf_counter(), device)  # the warm-up's kernels finish before the clock starts
    t0 = time.perf_counter()
    for _ in range(cfg.memory_steps):  # timed without the tracker (its per-op bookkeeping would dominate)
        step()
    row.step_seconds = elapsed(t0, device) / cfg.memory_steps  # the last step's kernels too
    tracker = LiveTensorTracker()
    with tracker:
        step()
    row.start_bytes, row.peak_bytes, row.avg_bytes = tracker.start_bytes, tracker.peak, int(tracker.average)
    # free them before the next configuration is built; rebinding also clears the references step() holds
    model = opt = batch = tracker = None
    gc.collect()
    return row


def measure_memory(cfg: PaperBenchConfig) -> list[MemoryRow]:
    """Measure every (size, optimizer) of ``cfg`` in this process, one after the other.

    A peer that cannot be imported yields a row with ``skipped`` set instead of an error.
    Each configuration's model and optimizer are freed (and garbage-collected) before the
    next is built, so the live-tensor totals of one never include another's.
    """
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    torch.set_num_threads(cfg.threads)
    groups = initialize_parallel(ParallelConfig(), seed=1)
    rows: list[MemoryRow] = []
    try:
        for hidden, layers in cfg.memory_sizes:
            for optimizer in cfg.optimizers:
                missing = peer_missing(optimizer) if optimizer in ("galore", "apollo") else None
                if missing:
                    rows.append(MemoryRow(hidden=hidden, layers=layers, optimizer=optimizer, skipped=missing))
                    continue
                row = _measure_one(cfg, hidden, layers, optimizer, groups)
                logger.info("memory h=%d L=%d %-6s peak %.1f MiB avg %.1f MiB (%.2fs/step)", hidden, layers,
                            optimizer, row.peak_bytes / MiB, row.avg_bytes / MiB, row.step_seconds)
                rows.append(row)
    finally:
        destroy_parallel()
    return rows


def planner_rows(cfg: PaperBenchConfig, *, rank: int = 128, max_tp: int = 8) -> list[dict]:
    """Planner totals per GPU (GiB) for each preset: adam and logra from the planner, galore and
    apollo derived from the dense plan (target moments → rank-r moments + projector)."""
    from megatron_logra.memory import PlanConfig, compare
    from megatron_logra.memory.cli import auto_tp
    from megatron_logra.memory.units import GiB
    from megatron_logra.models.presets import get_preset

    out = []
    for name in cfg.planner_presets:
        model = get_preset(name)
        tp = auto_tp(model, max_tp)  # the largest TP <= max_tp the model's heads allow (1.5B: 2)
        base = PlanConfig(tp=tp, rank=rank, recompute="full", seq_len=4096)
        dense, logra = compare(model, base)
        w = dense.worst
        # moments of a rank-r projected target: 2 fp32 [n_out, r] (or [r, n_in]) + projector [r, min side]
        low_rank_state = sum(t.layers * (8 * rank * max(t.n_out, t.n_in) + 4 * rank * min(t.n_out, t.n_in))
                             for t in w.counts.targets)
        target_moments = 8 * w.counts.target_params // base.dp
        peer_total = w.total - target_moments + low_rank_state
        row = {"preset": name, "tp": tp, "rank": rank, "adam": w.total / GiB, "logra": logra.worst.total / GiB,
               "galore": peer_total / GiB, "apollo": peer_total / GiB, "gpu": base.gpu_memory_bytes / GiB,
               "adam_verdict": dense.verdict, "logra_verdict": logra.verdict}
        out.append(row)
    return out


def plot_memory(rows: list[MemoryRow], planned: list[dict], optimizers: list[str], path: Path) -> Path:
    """Two panels: measured peak (bars) and average (dots) per size; planner totals per preset."""
    plt = pyplot()

    colors = {"adam": "tab:gray", "logra": "tab:blue", "galore": "tab:orange", "apollo": "tab:green"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=80)
    sizes = sorted({(r.hidden, r.layers) for r in rows})
    width = 0.8 / max(1, len(optimizers))
    for k, opt in enumerate(optimizers):
        xs, peaks, avgs = [], [], []
        for i, size in enumerate(sizes):
            r = next((r for r in rows if (r.hidden, r.layers) == size and r.optimizer == opt and not r.skipped), None)
            if r is None:
                continue
            xs.append(i + (k - (len(optimizers) - 1) / 2) * width)
            peaks.append(r.peak_bytes / MiB)
            avgs.append(r.avg_bytes / MiB)
        ax1.bar(xs, peaks, width, label=f"{opt} peak", color=colors.get(opt), alpha=0.8)
        ax1.plot(xs, avgs, "k.", markersize=6)
    ax1.set_xticks(range(len(sizes)), [f"h{h} L{L}" for h, L in sizes])
    ax1.set_ylabel("MiB (bars: peak, dots: average)")
    ax1.set_yscale("log")
    ax1.set_title("measured, one training step (CPU, bf16)")
    ax1.legend(fontsize=7)
    for k, opt in enumerate(optimizers):
        xs = [i + (k - (len(optimizers) - 1) / 2) * width for i in range(len(planned))]
        ax2.bar(xs, [p[opt] for p in planned], width, label=opt, color=colors.get(opt), alpha=0.8)
    if planned:
        ax2.axhline(planned[0]["gpu"], color="r", lw=1, ls="--", label="GPU memory")
    ax2.set_xticks(range(len(planned)), [p["preset"] for p in planned])
    ax2.set_ylabel("GiB per GPU")
    ax2.set_title("planner per GPU: TP " + "/".join(str(p["tp"]) for p in planned) + ", r 128, full recompute")
    ax2.legend(fontsize=7)
    return save_figure(fig, path)

