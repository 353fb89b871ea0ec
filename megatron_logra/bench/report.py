"""``docs/results.md``: the paper figures' numbers as tables, the PNGs, and a plain verdict.

The verdict section is computed from the numbers (:mod:`~megatron_logra.bench.verdicts`), never written by
hand. The header names the command that reproduces the run and the machine it ran on
(:mod:`~megatron_logra.bench.provenance`). Only the complete preset runs write ``results.md`` /
``results-quick.md``: a run of some figures or with other settings writes a stem that names them
(:func:`~megatron_logra.bench.report_names.report_stem`), so it never replaces the full report nor another run's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from megatron_logra.bench.accuracy_fig import LABELS, RunResult, mean_sd
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.memory_fig import MemoryRow
from megatron_logra.bench.provenance import command_line, describe_environment
from megatron_logra.bench.report_names import FIGURES, is_custom, report_stem
from megatron_logra.bench.verdicts import MiB, accuracy_summary, verdicts

logger = logging.getLogger(__name__)

__all__ = ["render_report", "write_report"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``header`` and ``rows`` (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_report(cfg: PaperBenchConfig, *, timings: dict[str, float], missing: dict[str, str],
                  memory: list[MemoryRow], planned: list[dict], by_optimizer: dict[str, list[RunResult]],
                  by_rank: dict[int, list[RunResult]], cosines: Optional[dict], kl_rows: list[dict],
                  images: dict[str, str], command: Optional[str] = None,
                  environment: Optional[dict[str, Any]] = None) -> str:
    """The markdown text of the report. ``command`` defaults to
    :func:`~megatron_logra.bench.provenance.command_line` of ``cfg``; ``environment`` is what
    :func:`~megatron_logra.bench.provenance.environment` recorded (None: a report from before it was recorded,
    described as :data:`~megatron_logra.bench.provenance.LEGACY_ENVIRONMENT`)."""
    cmd = command if command is not None else command_line(cfg)
    budget = "quick" if cfg.quick else "full"
    if report_stem(cfg) in ("results", "results-quick"):
        scope = f"{budget} run"
    else:
        scope = f"{budget} budget, " + (f"{', '.join(f for f in FIGURES if f in cfg.figures)} only"
                                       if set(cfg.figures) != set(FIGURES) else "all figures")
        scope += ", settings changed: see the command" if is_custom(cfg) else ""
    parts = [f"# Paper figures at small scale ({scope})", "",
             f"Command: `{cmd}` ({describe_environment(environment, cfg.threads)}). Total wall time "
             f"**{timings.get('total', 0.0) / 60:.1f} min** "
             f"(" + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items() if k != "total") + ").", ""]
    if missing:
        parts += ["**Skipped peers**: " + "; ".join(f"{k}: {v}" for k, v in missing.items()), ""]
    parts += ["## Where LoGRA wins and loses", ""]
    parts += [f"- {line}" for line in verdicts(memory, planned, by_optimizer, cosines, kl_rows, cfg.theory_tolerance)]
    if memory:
        rows = [[f"{r.hidden}/{r.layers}", LABELS[r.optimizer], f"{r.params / 1e6:.2f}M", str(r.rank),
                 "skipped" if r.skipped else f"{r.start_bytes / MiB:.1f}",
                 "—" if r.skipped else f"{r.peak_bytes / MiB:.1f}", "—" if r.skipped else f"{r.avg_bytes / MiB:.1f}",
                 "—" if r.skipped else f"{r.step_seconds:.2f}"] for r in memory]
        parts += ["", "## Fig 1: training memory", "",
                  f"Measured: live tensor bytes over one full training step after a warm-up and {cfg.memory_steps} timed "
                  f"step(s) (s/step: their mean, without tracking; bf16 GEMMs on a CPU without bf16 units, on a machine "
                  f"shared with other jobs, so step times are noisy and not a speed claim) "
                  f"(bf16 weights, micro-batch {cfg.memory_micro_batch} x {cfg.memory_seq} tokens, rank = hidden/"
                  f"{cfg.memory_rank_divisor}; GaLore/APOLLO on the LoGRA targets, AdamW on the rest).", "",
                  _table(["hidden/layers", "optimizer", "params", "rank", "start MiB", "peak MiB", "average MiB",
                          "s/step"], rows), ""]
        if planned:
            prow = [[p["preset"], str(p["tp"]), f"{p['adam']:.1f}", f"{p['logra']:.1f}", f"{p['galore']:.1f}",
                     p["adam_verdict"], p["logra_verdict"]] for p in planned]
            parts += ["Planner (`megatron_logra.memory`, per GPU, 80 GiB, rank 128, full recompute, seq 4096; "
                      "GaLore/APOLLO derived from the dense plan: target Adam moments replaced by rank-r moments "
                      "and a projector, dense fp32 gradient kept):", "",
                      _table(["preset", "TP", "dense AdamW GiB", "LoGRA GiB", "GaLore/APOLLO GiB", "dense verdict",
                              "LoGRA verdict"], prow), ""]
        parts += [f"![Fig 1]({images['memory']})", ""] if "memory" in images else []
    if by_optimizer:
        rows = []
        for opt, runs in by_optimizer.items():
            a = accuracy_summary(runs)
            if a is None:
                rows.append([LABELS[opt], "skipped", "—", "—", "—"])
                continue
            ok = [r for r in runs if not r.skipped]
            wall = sum(r.rl_seconds for r in ok) / len(ok)
            rows.append([LABELS[opt], f"{ok[0].eval_before:.3f}", f"{a[0]:.3f} ± {a[1]:.3f}", str(a[2]),
                         f"{wall:.0f}"])
        parts += ["## Fig 2: held-out accuracy over updates", "",
                  f"The tiny RL recipe (chain_sum, warm start with a careless teacher), {cfg.rl_steps} updates, "
                  f"seeds {cfg.seeds}, held-out greedy accuracy on 200 problems every {cfg.eval_interval} updates. "
                  f"LoGRA is the `tiny` recipe: RowAdam on the target matrices, non-targets frozen, predicted-KL "
                  f"step control with calibration. Dense AdamW, GaLore and APOLLO use the `tiny-adam` recipe: AdamW "
                  f"on the non-targets (embeddings, norms, output layer), no KL control; GaLore (SVD projector, "
                  f"refreshed every {cfg.peer_update_proj_gap} updates, scale {cfg.galore_scale}) and APOLLO "
                  f"(random projector, channel-wise scaling, scale {cfg.apollo_scale}) at LoGRA's rank 32 on the "
                  f"target matrices. Same lr (1e-4) for all. RL-loop time excludes model build and warm-start load.",
                  "",
                  _table(["optimizer", "before", "after (mean ± sd)", "seeds", "RL-loop s / run"], rows), ""]
        parts += [f"![Fig 2]({images['accuracy']})", ""] if "accuracy" in images else []
    if by_rank:
        rows = [[str(k), f"{mean_sd([r.eval_after for r in v])[0]:.3f} ± {mean_sd([r.eval_after for r in v])[1]:.3f}",
                 str(len(v))] for k, v in sorted(by_rank.items())]
        parts += ["## Fig 5a: accuracy vs rank", "", _table(["rank", "held-out after (mean ± sd)", "seeds"], rows), ""]
        parts += [f"![Fig 5a]({images['rank']})", ""] if "rank" in images else []
    if cosines:
        rows = [[f"L{r['layer']} {r['module']}", str(r["n_in"]), r["distribution"], f"{r['theory']:.3f}",
                 f"{r['single_mc']:.3f} ± {r['single_mc_se']:.3f}", f"{r['single_mc'] / r['theory'] - 1:+.1%}",
                 f"{r['single']:.3f}", f"{r['accumulated']:.3f}",
                 f"{next(x['accumulated'] for x in cosines['rows'] if x['name'] == r['name'] and x['distribution'] == r['distribution'] and not x['refresh']):.3f}"]
                for r in cosines["rows"] if r["refresh"]]
        parts += ["## Fig 5b/5c: gradient reconstruction cosine", "",
                  f"Rank {cosines['rank']}, k = {cosines['k']} batches of {cfg.cosine_batch} sequences of the RL task "
                  f"(prompt + reference answer, LM loss) on the {'warm-start' if cosines['warm_start'] else 'random'} "
                  f"model. Dense G by autograd; sketches by the capture path (equal to G·Aᵀ within "
                  f"{cosines['capture_max_rel_err']:.1e} relative). Single step: mean over k gradients x "
                  f"{cfg.cosine_draws} projections (± standard error); captured: mean over the k captured steps.", "",
                  _table(["target", "n_in", "distribution", "theory", "single step (MC)", "vs theory",
                          "single step (captured)", f"Σ{cosines['k']} refreshed", f"Σ{cosines['k']} fixed"], rows), ""]
        for key in ("cosine_single", "cosine_accumulated"):
            if key in images:
                parts += [f"![{key}]({images[key]})", ""]
    if kl_rows:
        rows = [[r["label"], f"{r['acc']:.3f} ± {r['sd']:.3f}", str(r["n"]), f"{r['length_tail']:.2f}",
                 f"{r['kl_median']:.2e}", f"{r['kl_max']:.2e}", f"{r['kl_over_budget_median']:.2f}"] for r in kl_rows]
        parts += ["## Fig 6: KL handling", "",
                  f"LoGRA on the same task; k3 coefficient {cfg.k3_coef}. Actual KL measured on the probe set after "
                  "every update in every variant; 'actual/budget' is the median ratio to the controller's budget.", "",
                  _table(["variant", "held-out after", "seeds", "response length (last quarter)",
                          "median actual KL", "max actual KL", "actual/budget"], rows), ""]
        parts += [f"![Fig 6]({images['kl']})", ""] if "kl" in images else []
    return "\n".join(parts) + "\n"


def write_report(cfg: PaperBenchConfig, text: str, data: dict[str, Any]) -> Path:
    """Write ``STEM.md`` and the raw numbers as ``results/STEM.json`` under ``cfg.out_dir``, ``STEM`` =
    :func:`~megatron_logra.bench.report_names.report_stem` (``results``, ``results-quick``, ``results-cosine``,
    ...): a quick, partial or custom run never overwrites the full report."""
    out = Path(cfg.out_dir)
    (out / "results").mkdir(parents=True, exist_ok=True)
    stem = report_stem(cfg)
    path = out / f"{stem}.md"
    path.write_text(text)
    (out / "results" / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    logger.info("wrote %s", path)
    return path
