"""The "where LoGRA wins and loses" lines of a paper-bench report, computed from the numbers.

The verdicts are never written by hand, so a rerun that changes the numbers changes the words: every
comparison states the two values and whether LoGRA is ahead, behind, or within one standard deviation
(with one seed there is no standard deviation and the line says it is a single-run difference).
"""

from __future__ import annotations

import logging
from typing import Optional

from megatron_logra.bench.accuracy_fig import LABELS, RunResult, mean_sd
from megatron_logra.bench.memory_fig import MemoryRow

logger = logging.getLogger(__name__)

__all__ = ["MiB", "accuracy_summary", "verdicts"]

MiB = 1024.0 * 1024.0


def accuracy_summary(runs: list[RunResult]) -> Optional[tuple[float, float, int]]:
    """Mean and sd of the held-out accuracy after RL over the runs that were not skipped, and their number;
    None when every run was skipped."""
    runs = [r for r in runs if not r.skipped]
    if not runs:
        return None
    m, s = mean_sd([r.eval_after for r in runs])
    return m, s, len(runs)


def _compare(name: str, logra: float, other: float, sd: float, unit: str, higher_is_better: bool) -> str:
    diff = logra - other
    better = diff > sd if higher_is_better else diff < -sd
    worse = diff < -sd if higher_is_better else diff > sd
    word = "**wins**" if better else "**loses**" if worse else "ties (within one sd)"
    spread = f"sd {sd:.3f}" if sd > 0 else "one seed: no sd, a single-run difference"
    return f"LoGRA {word} vs {name}: {logra:.3f} vs {other:.3f}{unit} (difference {diff:+.3f}, {spread})"


def verdicts(memory: list[MemoryRow], planned: list[dict], by_optimizer: dict[str, list[RunResult]],
             cosines: Optional[dict], kl_rows: list[dict], tolerance: float) -> list[str]:
    """One line per comparison, with the numbers (see the module docstring)."""
    out: list[str] = []
    if memory:
        size = max((r.hidden, r.layers) for r in memory)
        at = {r.optimizer: r for r in memory if (r.hidden, r.layers) == size and not r.skipped}
        if "logra" in at:
            lo = at["logra"]
            for opt, r in at.items():
                if opt == "logra":
                    continue
                word = "**wins**" if lo.peak_bytes < r.peak_bytes else "**loses**"
                out.append(f"Memory (measured, hidden {size[0]}, {size[1]} layer(s)): LoGRA {word} vs {LABELS[opt]}: "
                           f"peak {lo.peak_bytes / MiB:.1f} vs {r.peak_bytes / MiB:.1f} MiB "
                           f"({lo.peak_bytes / r.peak_bytes:.2f}x), average {lo.avg_bytes / MiB:.1f} vs "
                           f"{r.avg_bytes / MiB:.1f} MiB ({lo.avg_bytes / r.avg_bytes:.2f}x); step time "
                           f"{lo.step_seconds:.2f} vs {r.step_seconds:.2f} s (one step on a shared machine: noisy)")
    for p in planned:
        out.append(f"Memory (planner, {p['preset']}, TP {p['tp']}): LoGRA {p['logra']:.1f} GiB vs dense AdamW "
                   f"{p['adam']:.1f} GiB ({p['logra'] / p['adam']:.2f}x) vs GaLore/APOLLO (derived) "
                   f"{p['galore']:.1f} GiB ({p['logra'] / p['galore']:.2f}x)")
    lo = accuracy_summary(by_optimizer.get("logra", []))
    if lo:
        for opt, runs in by_optimizer.items():
            other = accuracy_summary(runs)
            if opt == "logra" or other is None:
                continue
            out.append("Held-out accuracy after RL: " + _compare(LABELS[opt], lo[0], other[0], max(lo[1], other[1]),
                                                                 "", True) + f" (n = {lo[2]} / {other[2]} seeds)")
            lw = sum(r.rl_seconds for r in by_optimizer["logra"]) / max(1, len(by_optimizer["logra"]))
            ow = sum(r.rl_seconds for r in runs if not r.skipped) / max(1, other[2])
            out.append(f"RL-loop wall time per run (rollouts, updates, evaluations): LoGRA {lw:.0f} s vs "
                       f"{LABELS[opt]} {ow:.0f} s ({lw / ow:.2f}x)")
    if cosines:
        for dist in ("rademacher", "gaussian"):
            sel = [r for r in cosines["rows"] if r["distribution"] == dist and r["refresh"]]
            if not sel:
                continue
            devs = [abs(r["single_mc"] / r["theory"] - 1) for r in sel]
            inside = sum(d <= tolerance for d in devs)
            out.append(f"Single-step cosine vs sqrt(r/(r+n_in)), {dist}: {inside}/{len(sel)} targets within "
                       f"{tolerance:.0%} (mean |deviation| {sum(devs) / len(devs):.1%}, max {max(devs):.1%})")
        fixed = [r["accumulated"] for r in cosines["rows"] if not r["refresh"] and r["distribution"] == "rademacher"]
        fresh = [r["accumulated"] for r in cosines["rows"] if r["refresh"] and r["distribution"] == "rademacher"]
        if fixed and fresh:
            out.append(f"Accumulated over k={cosines['k']} steps (Rademacher): refreshed projections reach mean cosine "
                       f"{sum(fresh) / len(fresh):.3f}, a fixed projection {sum(fixed) / len(fixed):.3f}")
    by_mode = {r["mode"]: r for r in kl_rows}
    if "calibrated" in by_mode:
        c = by_mode["calibrated"]
        for mode in ("none", "k3", "predicted"):
            if mode in by_mode:
                o = by_mode[mode]
                out.append(f"KL control, calibrated vs {o['label']}: held-out {c['acc']:.3f} vs {o['acc']:.3f}, "
                           f"median actual KL per update {c['kl_median']:.2e} vs {o['kl_median']:.2e}, "
                           f"max {c['kl_max']:.2e} vs {o['kl_max']:.2e}")
    return out
