"""Fig 6: KL handling of LoGRA on the tiny RL task — accuracy, response length, actual KL per step.

Four variants of the ``tiny`` recipe (same model, data and seeds; only the KL handling differs):

* ``none``: ``kl.mode=none`` — α = 1, the optimizer's own step (RowAdam at the recipe's lr);
* ``k3``: ``kl.mode=none`` plus a k3 penalty to the warm-start policy in the loss
  (``rl.loss.kl_coef``, ``rl.loss.kl_estimator=k3``) — the usual RLHF regulariser;
* ``predicted``: ``kl.mode=predicted`` — α from the forward-mode predicted KL and the budget;
* ``calibrated``: ``kl.mode=calibrated`` (the recipe) — predicted KL corrected in closed loop
  by the measured KL after each step.

The actual KL(π_old ‖ π_new) of every update is measured on the probe set in every variant
(``kl.measure_actual``), so the panels compare like with like.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from megatron_logra.bench.accuracy_fig import RunCache, RunResult, curve_stats, mean_sd
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.plot import pyplot, save_figure

logger = logging.getLogger(__name__)

__all__ = ["KL_OVERRIDES", "kl_runs", "kl_summary", "plot_kl"]

KL_OVERRIDES = {
    "none": ["kl.mode=none"],
    "k3": ["kl.mode=none", "rl.loss.kl_estimator=k3"],
    "predicted": ["kl.mode=predicted"],
    "calibrated": [],
}
LABELS = {"none": "no KL control", "k3": "k3 penalty", "predicted": "predicted-KL step",
          "calibrated": "predicted-KL + calibration"}
COLORS = {"none": "tab:red", "k3": "tab:purple", "predicted": "tab:cyan", "calibrated": "tab:blue"}


def kl_runs(cfg: PaperBenchConfig, cache: RunCache) -> dict[str, list[RunResult]]:
    """Run (or reuse) every KL variant of ``cfg.kl_modes`` for every seed of ``cfg.kl_seeds``.

    ``calibrated`` is the recipe, i.e. the LoGRA run of Fig 2 (label ``logra``), reused from ``cache``."""
    out: dict[str, list[RunResult]] = {}
    for mode in cfg.kl_modes:
        extra = list(KL_OVERRIDES[mode])
        if mode == "k3":
            extra.append(f"rl.loss.kl_coef={cfg.k3_coef}")
        label = "logra" if mode == "calibrated" else f"logra-kl-{mode}"
        out[mode] = [cache.get(label, seed, "logra", extra=extra) for seed in cfg.kl_seeds]
    return out


def _values(runs: list[RunResult], key: str) -> list[float]:
    return [float(r[key]) for run in runs for r in run.records if r.get(key) is not None]


def kl_summary(by_mode: dict[str, list[RunResult]]) -> list[dict]:
    """Per variant: final held-out accuracy (mean ± sd), mean response length over the last
    quarter of updates, median / max actual KL per update, and the median of actual / budget
    (controlled variants: how close the step lands to the budget it aimed at)."""
    rows = []
    for mode, runs in by_mode.items():
        acc, sd = mean_sd([r.eval_after for r in runs])
        tail = []
        for run in runs:
            recs = run.records[-max(1, len(run.records) // 4):]
            tail += [float(r["response_length"]) for r in recs if r.get("response_length") is not None]
        kls = _values(runs, "kl_actual")
        ratios = [float(r["kl_actual"]) / float(r["budget"]) for run in runs for r in run.records
                  if r.get("kl_actual") is not None and r.get("budget")]
        rows.append({"mode": mode, "label": LABELS[mode], "acc": acc, "sd": sd, "n": len(runs),
                     "length_tail": statistics.mean(tail) if tail else float("nan"),
                     "kl_median": statistics.median(kls) if kls else float("nan"),
                     "kl_max": max(kls) if kls else float("nan"),
                     "kl_over_budget_median": statistics.median(ratios) if ratios else float("nan")})
    return rows


def _per_step(runs: list[RunResult], key: str) -> tuple[list[int], list[float]]:
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for r in run.records:
            if r.get(key) is not None:
                by_step.setdefault(int(r["step"]), []).append(float(r[key]))
    steps = sorted(by_step)
    return steps, [statistics.mean(by_step[s]) for s in steps]


def plot_kl(by_mode: dict[str, list[RunResult]], path: Path) -> Path:
    """Three panels over RL updates: held-out accuracy, mean response length, actual KL (log)."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=80)
    for mode, runs in by_mode.items():
        color, label = COLORS[mode], LABELS[mode]
        steps, means, _ = curve_stats(runs)
        axes[0].plot(steps, means, "-o", ms=3, color=color, label=label)
        s, v = _per_step(runs, "response_length")
        axes[1].plot(s, v, "-", color=color, label=label)
        s, v = _per_step(runs, "kl_actual")
        axes[2].plot(s, v, "-", color=color, label=label)
        if mode in ("predicted", "calibrated"):
            s, b = _per_step(runs, "budget")
            axes[2].plot(s, b, ":", color=color, lw=1)
    axes[0].set_title("held-out accuracy")
    axes[1].set_title("response length (tokens)")
    axes[2].set_title("actual KL per update (dotted: budget)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("RL update")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return save_figure(fig, path)
