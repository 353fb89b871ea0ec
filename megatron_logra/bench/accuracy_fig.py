"""Fig 2 (held-out accuracy over updates per optimizer) and Fig 5a (accuracy vs rank).

Every run is the project's RL job (``megatron_logra.rl.job.run_rl``) on the tiny recipe —
the same model, warm start, task, held-out split and rollout seeds for every optimizer:

* ``logra``: recipe ``tiny`` (RowAdam, rank 32, predicted-KL step control with calibration);
* ``adam``: recipe ``tiny-adam`` (dense AdamW on every parameter, no KL control);
* ``galore`` / ``apollo``: recipe ``tiny-adam`` with the peer on the LoGRA target matrices and
  AdamW on the rest, plugged in through ``run_rl``'s ``optimizer_factory`` hook.

``train.seed`` varies the training randomness only (the task's train/held-out partition is the
warm start's, as in ``benchmarks/rl_parity.py``). Runs execute in this process one after the
other; their metrics stay in ``run_root/<label>-seed<k>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.peers import PeerSettings, peer_factory, peer_missing
from megatron_logra.plot import pyplot, save_figure

logger = logging.getLogger(__name__)

__all__ = ["RunResult", "RunCache", "run_rl_job", "optimizer_spec", "mean_sd", "curve_stats", "plot_accuracy",
           "plot_rank"]

LABELS = {"logra": "LoGRA", "adam": "dense AdamW", "galore": "GaLore", "apollo": "APOLLO"}
COLORS = {"logra": "tab:blue", "adam": "tab:gray", "galore": "tab:orange", "apollo": "tab:green"}


@dataclass
class RunResult:
    """What the figures need from one RL run."""

    label: str
    seed: int
    eval_before: float = float("nan")
    eval_after: float = float("nan")
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(update, held-out accuracy), update 0 = the warm start."""
    records: list[dict] = field(default_factory=list)
    """Per-update metrics (response_length, kl_actual, kl_predicted, alpha, accuracy, ...)."""
    wall_seconds: float = 0.0
    """Whole run including model build and warm-start load (the first run also pays lazy imports)."""
    rl_seconds: float = 0.0
    """The RL loop alone (rollouts, updates, evaluations): the fair time comparison."""
    skipped: Optional[str] = None


def optimizer_spec(cfg: PaperBenchConfig, optimizer: str, rank: int = 32) -> tuple[str, list[str], Optional[Callable]]:
    """(recipe, overrides, optimizer_factory) of ``optimizer`` on the tiny RL task."""
    if optimizer == "logra":
        return "tiny", [f"optimizer.logra.rank={rank}"], None
    if optimizer == "adam":
        return "tiny-adam", [], None
    scale = cfg.galore_scale if optimizer == "galore" else cfg.apollo_scale
    settings = PeerSettings(rank=rank, update_proj_gap=cfg.peer_update_proj_gap, scale=scale)
    return "tiny-adam", [f"optimizer.logra.rank={rank}"], peer_factory(optimizer, settings)


def run_rl_job(cfg: PaperBenchConfig, *, label: str, recipe: str, seed: int, overrides: list[str],
               optimizer_factory: Optional[Callable] = None) -> RunResult:
    """One RL run in this process through ``run_rl``; tears the process group down afterwards."""
    import torch

    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl

    torch.set_num_threads(cfg.threads)
    run_dir = Path(cfg.run_root) / f"{label}-seed{seed}"
    job = parse_args_to_config(recipe, [f"train.seed={seed}", f"rl.steps={cfg.rl_steps}",
                                        f"rl.eval_interval={cfg.eval_interval}", f"train.run_dir={run_dir}",
                                        "train.overwrite=true", "train.progress=false", "train.log_interval=1000000",
                                        *overrides])
    t0 = time.perf_counter()
    try:
        summary = run_rl(job, optimizer_factory)
    finally:
        destroy_parallel()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = RunResult(label=label, seed=seed, eval_before=summary["eval_accuracy_before"],
                       eval_after=summary["eval_accuracy_after"], records=records,
                       wall_seconds=time.perf_counter() - t0, rl_seconds=float(summary["rl_seconds"]))
    result.curve = [(0, result.eval_before)] + [(int(r["step"]), float(r["eval_accuracy"])) for r in records
                                                if r.get("eval_accuracy") is not None]
    logger.info("%s seed %d: held-out %.3f -> %.3f in %.0fs", label, seed, result.eval_before, result.eval_after,
                result.wall_seconds)
    return result


class RunCache:
    """Runs by (label, seed), so a run shared by several figures (the recipe's LoGRA run is
    Fig 2's LoGRA, Fig 5a's rank 32 and Fig 6's calibrated variant) trains once."""

    def __init__(self, cfg: PaperBenchConfig) -> None:
        self.cfg = cfg
        self.runs: dict[tuple[str, int], RunResult] = {}

    def get(self, label: str, seed: int, optimizer: str = "logra", rank: int = 32,
            extra: Optional[list[str]] = None) -> RunResult:
        key = (label, seed)
        if key not in self.runs:
            missing = peer_missing(optimizer) if optimizer in ("galore", "apollo") else None
            if missing:
                self.runs[key] = RunResult(label=label, seed=seed, skipped=missing)
            else:
                recipe, overrides, factory = optimizer_spec(self.cfg, optimizer, rank)
                self.runs[key] = run_rl_job(self.cfg, label=label, recipe=recipe, seed=seed,
                                            overrides=overrides + list(extra or []), optimizer_factory=factory)
        return self.runs[key]

    def optimizer(self, optimizer: str, seed: int) -> RunResult:
        return self.get(optimizer, seed, optimizer)


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample sd (0 for a single value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def curve_stats(runs: list[RunResult]) -> tuple[list[int], list[float], list[float]]:
    """Updates and mean ± sd held-out accuracy at the updates every run evaluated."""
    steps = sorted(set.intersection(*[{s for s, _ in r.curve} for r in runs]))
    means, sds = [], []
    for s in steps:
        m, sd = mean_sd([dict(r.curve)[s] for r in runs])
        means.append(m)
        sds.append(sd)
    return steps, means, sds


def plot_accuracy(by_optimizer: dict[str, list[RunResult]], path: Path) -> Path:
    """Fig 2: held-out accuracy over updates, mean ± sd band over seeds, one line per optimizer."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=80)
    for opt, runs in by_optimizer.items():
        runs = [r for r in runs if not r.skipped]
        if not runs:
            continue
        steps, means, sds = curve_stats(runs)
        ax.plot(steps, means, "-o", ms=3, color=COLORS.get(opt), label=f"{LABELS.get(opt, opt)} (n={len(runs)})")
        ax.fill_between(steps, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                        color=COLORS.get(opt), alpha=0.2)
    ax.set_xlabel("RL update")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("tiny RL task (chain_sum), mean ± sd over seeds")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_rank(by_rank: dict[int, list[RunResult]], dense: list[RunResult], path: Path) -> Path:
    """Fig 5a: final held-out accuracy of LoGRA vs rank (mean ± sd), dense AdamW as a reference line."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=80)
    ranks = sorted(by_rank)
    stats = [mean_sd([r.eval_after for r in by_rank[k]]) for k in ranks]
    ax.errorbar(ranks, [m for m, _ in stats], yerr=[s for _, s in stats], fmt="-o", color=COLORS["logra"],
                capsize=3, label="LoGRA")
    dense = [r for r in dense if not r.skipped]
    if dense:
        m, s = mean_sd([r.eval_after for r in dense])
        ax.axhline(m, color=COLORS["adam"], ls="--", label=f"dense AdamW ({m:.2f})")
    before = next((r.eval_before for runs in by_rank.values() for r in runs), None)
    if before is not None:
        ax.axhline(before, color="k", ls=":", lw=1, label=f"warm start ({before:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(k) for k in ranks])
    ax.set_xlabel("sketch rank r (hidden 128)")
    ax.set_ylabel("final held-out accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
