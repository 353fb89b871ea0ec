"""``megatron-logra bench paper``: run every figure group of a config and write its report.

The figure groups run one after the other in this process, each timed, and the raw numbers are written
beside the report (``results/STEM.json``) so that ``--render-only`` can rewrite the report later without
rerunning anything. A missing GaLore/APOLLO package is logged and skipped, never fatal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from megatron_logra.bench.config import PaperBenchConfig

logger = logging.getLogger(__name__)

__all__ = ["run_paper"]


def run_paper(cfg: PaperBenchConfig) -> Path:
    """Run every figure group of ``cfg`` and write the report; returns the report's path."""
    import torch

    from megatron_logra.bench import accuracy_fig, cosine_fig, kl_fig, memory_fig, provenance, report, report_names
    from megatron_logra.bench.peers import PEERS, peer_missing

    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    missing = {p: why for p in cfg.optimizers if p in PEERS for why in [peer_missing(p)] if why}
    for peer, why in missing.items():
        logger.warning("peer %s skipped: %s", peer, why)
    env = provenance.environment(cfg.threads)
    img_dir = Path(cfg.out_dir) / "results"
    prefix = report_names.image_prefix(cfg)
    images: dict[str, str] = {}

    def image(key: str, name: str) -> Path:
        images[key] = f"results/{prefix}{name}"
        return img_dir / f"{prefix}{name}"

    memory, planned = [], []
    if "memory" in cfg.figures:
        t0 = time.perf_counter()
        memory = memory_fig.measure_memory(cfg)
        planned = memory_fig.planner_rows(cfg)
        memory_fig.plot_memory(memory, planned, cfg.optimizers, image("memory", "fig1_memory.png"))
        timings["memory"] = time.perf_counter() - t0
    cache = accuracy_fig.RunCache(cfg)
    by_optimizer: dict[str, list] = {}
    by_rank: dict[int, list] = {}
    if "accuracy" in cfg.figures:
        t0 = time.perf_counter()
        for seed in cfg.seeds:  # seed-major: a partial run still has every optimizer side by side
            for opt in cfg.optimizers:
                by_optimizer.setdefault(opt, []).append(cache.optimizer(opt, seed))
        accuracy_fig.plot_accuracy(by_optimizer, image("accuracy", "fig2_accuracy.png"))
        for rank in cfg.ranks:
            label = "logra" if rank == 32 else f"logra-r{rank}"
            by_rank[rank] = [cache.get(label, seed, "logra", rank=rank) for seed in cfg.rank_seeds]
        accuracy_fig.plot_rank(by_rank, by_optimizer.get("adam", []), image("rank", "fig5a_rank.png"))
        timings["accuracy"] = time.perf_counter() - t0
    cosines: Optional[dict] = None
    if "cosine" in cfg.figures:
        t0 = time.perf_counter()
        cosines = cosine_fig.measure_cosines(cfg)
        cosine_fig.plot_cosines(cosines, image("cosine_single", "fig5b_cosine_single.png"),
                                image("cosine_accumulated", "fig5c_cosine_accumulated.png"))
        timings["cosine"] = time.perf_counter() - t0
    kl_rows: list[dict] = []
    if "kl" in cfg.figures:
        t0 = time.perf_counter()
        by_mode = kl_fig.kl_runs(cfg, cache)
        kl_rows = kl_fig.kl_summary(by_mode)
        kl_fig.plot_kl(by_mode, image("kl", "fig6_kl.png"))
        timings["kl"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    command = provenance.command_line(cfg)
    text = report.render_report(cfg, timings=timings, missing=missing, memory=memory, planned=planned,
                                by_optimizer=by_optimizer, by_rank=by_rank, cosines=cosines, kl_rows=kl_rows,
                                images=images, command=command, environment=env)
    data = {"config": asdict(cfg), "command": command, "environment": env, "timings": timings, "missing": missing,
            "memory": [asdict(r) for r in memory], "planner": planned,
            "runs": {f"{k[0]}-seed{k[1]}": {"eval_before": r.eval_before, "eval_after": r.eval_after,
                                            "curve": r.curve, "wall_seconds": r.wall_seconds, "rl_seconds": r.rl_seconds,
                                            "skipped": r.skipped}
                     for k, r in cache.runs.items()},
            "cosines": cosines, "kl": kl_rows}
    path = report.write_report(cfg, text, data)
    logger.info("bench paper done in %.1f min: %s", timings["total"] / 60, path)
    return path
