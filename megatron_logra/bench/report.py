"""``docs/results.md``: the paper figures' numbers as tables, the PNGs, and a plain verdict.

The verdict section is computed from the numbers (never written by hand), so a rerun that
changes the numbers changes the words: for every comparison it states the two values and
whether LoGRA is ahead, behind, or within one standard deviation.

The header names the command that reproduces the run (:func:`command_line`, every flag that
differs from the preset) and the machine it ran on (:func:`environment`, recorded in the JSON).
Only the complete preset runs write ``results.md`` / ``results-quick.md``: a run of some figures
or with other settings writes a stem that names them (:func:`report_stem`, e.g.
``results-cosine.md``, ``results-quick-seeds_1_2-memory-kl.md``), so it never replaces the full report
nor another run's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from megatron_logra.bench.accuracy_fig import LABELS, RunResult, mean_sd
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.memory_fig import MemoryRow

logger = logging.getLogger(__name__)

__all__ = ["render_report", "write_report", "verdicts", "report_stem", "image_prefix", "legacy_report_stem",
           "legacy_image_prefix", "command_line", "environment", "cpu_model"]

MiB = 1024.0 * 1024.0

FIGURES = ("memory", "accuracy", "cosine", "kl")
"""The figure groups, in report order."""

LEGACY_ENVIRONMENT = "OMP_NUM_THREADS=1, {threads} torch thread(s), x86_64 CPU, shared 2-core machine"
"""The machine of reports whose JSON predates the recorded environment (the project's shared 2-core x86_64
machine, where the committed reports were measured)."""


def _plain(cfg: PaperBenchConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg)))


def _changed_settings(cfg: PaperBenchConfig) -> dict[str, Any]:
    """The settings in which ``cfg`` differs from its preset (the figures, output and run directories aside),
    in field order, as JSON values. ``eval_interval`` counts only when it is not what ``--rl-steps`` alone
    gives it (``min(preset's interval, rl_steps)``)."""
    preset = PaperBenchConfig.preset(cfg.quick, out_dir=cfg.out_dir, run_root=cfg.run_root, figures=list(cfg.figures))
    mine, theirs = _plain(cfg), _plain(preset)
    theirs["eval_interval"] = min(preset.eval_interval, cfg.rl_steps)
    return {k: v for k, v in mine.items() if v != theirs[k]}


def _is_custom(cfg: PaperBenchConfig) -> bool:
    """Any setting other than the preset's (the figures, output and run directories aside)."""
    preset = PaperBenchConfig.preset(cfg.quick, out_dir=cfg.out_dir, run_root=cfg.run_root, figures=list(cfg.figures))
    return _plain(cfg) != _plain(preset)


def _name_part(value: Any) -> str:
    """``value`` (a JSON value of a setting) in a file name: list entries joined by ``_``, pairs by ``x``
    (``[[64, 1], [128, 1]]`` -> ``64x1_128x1``), other characters than letters, digits, ``.`` and ``-`` dropped."""
    if isinstance(value, list):
        return "_".join("x".join(map(_name_part, v)) if isinstance(v, list) else _name_part(v) for v in value)
    if isinstance(value, float):
        value = f"{value:g}"
    return re.sub(r"[^A-Za-z0-9.-]+", "", str(value))


SETTINGS_NAME_LIMIT = 120
"""Longest settings part of a report stem; a longer one is replaced by ``custom-`` and a hash of the settings."""


def _settings_name(cfg: PaperBenchConfig) -> str:
    """The part of the report stem naming the settings that differ from the preset (:func:`_changed_settings`),
    ``NAME_VALUES`` joined by ``-`` (``seeds_1_2-rl-steps_3``); empty for a preset run. Beyond
    :data:`SETTINGS_NAME_LIMIT` characters: ``custom-`` and the first 10 hex digits of the settings' SHA-256."""
    changed = _changed_settings(cfg)
    name = "-".join(f"{k.replace('_', '-')}_{_name_part(v)}" for k, v in changed.items())
    if len(name) > SETTINGS_NAME_LIMIT:
        digest = hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]
        name = f"custom-{digest}"
    return name


def report_stem(cfg: PaperBenchConfig) -> str:
    """File stem of the report and its JSON: ``results`` / ``results-quick`` for a complete preset run; the
    settings that differ from the preset when any do, each as ``NAME_VALUES`` (``results-seeds_1``,
    ``results-quick-rl-steps_10-optimizers_logra_adam``, so runs of different settings never share a name), and
    the figure groups (``-cosine``, ``-memory-kl``) when not all of them ran."""
    stem = "results-quick" if cfg.quick else "results"
    settings = _settings_name(cfg)
    if settings:
        stem += f"-{settings}"
    if set(cfg.figures) != set(FIGURES):
        stem += "".join(f"-{f}" for f in FIGURES if f in cfg.figures)
    return stem


def image_prefix(cfg: PaperBenchConfig) -> str:
    """Prefix of the PNG names under ``OUT_DIR/results/``: none for the full report, else the stem's suffix
    (``quick-``, ``cosine-``, ``quick-seeds_1-memory-``)."""
    stem = report_stem(cfg)
    return "" if stem == "results" else stem[len("results-"):] + "-"


def legacy_report_stem(cfg: PaperBenchConfig) -> Optional[str]:
    """The stem an earlier version gave the report of ``cfg`` when it differs from :func:`report_stem`, else None:
    every run with settings other than the preset's was ``results[-quick]-custom[-FIGURE...]`` whatever they were
    (so one such JSON may hold the run of any custom settings: :func:`~megatron_logra.bench.cli.render_only`
    checks its recorded config)."""
    if not _is_custom(cfg):
        return None
    stem = ("results-quick" if cfg.quick else "results") + "-custom"
    if set(cfg.figures) != set(FIGURES):
        stem += "".join(f"-{f}" for f in FIGURES if f in cfg.figures)
    return stem if stem != report_stem(cfg) else None


def legacy_image_prefix(cfg: PaperBenchConfig) -> Optional[str]:
    """The PNG prefix that went with :func:`legacy_report_stem` (``quick-custom-memory-``), or None."""
    stem = legacy_report_stem(cfg)
    return None if stem is None else stem[len("results-"):] + "-"


def command_line(cfg: PaperBenchConfig) -> str:
    """The ``megatron-logra bench paper`` command that runs ``cfg``: ``--quick`` and every flag whose value
    differs from the preset's; settings no flag reaches (set through the API) are listed after it."""
    from megatron_logra.bench.cli import build_parser, config_from_args

    preset = PaperBenchConfig.preset(cfg.quick)
    args = ["paper"] + (["--quick"] if cfg.quick else [])
    for flag, name in (("--out-dir", "out_dir"), ("--run-root", "run_root")):
        if getattr(cfg, name) != getattr(preset, name):
            args += [flag, getattr(cfg, name)]
    for flag, name in (("--figures", "figures"), ("--optimizers", "optimizers"), ("--kl-modes", "kl_modes"),
                       ("--seeds", "seeds")):
        if list(getattr(cfg, name)) != list(getattr(preset, name)):
            args += [flag, *map(str, getattr(cfg, name))]
    if cfg.rl_steps != preset.rl_steps:
        args += ["--rl-steps", str(cfg.rl_steps)]
    text = shlex.join(["megatron-logra", "bench", *args])
    rebuilt, wanted = _plain(config_from_args(build_parser().parse_args(args))), _plain(cfg)
    rest = [f"{k}={wanted[k]!r}" for k in wanted if wanted[k] != rebuilt[k]]
    return text + (f" (and, through the API: {', '.join(rest)})" if rest else "")


def cpu_model() -> str:
    """The CPU's model name: the first ``model name`` of ``/proc/cpuinfo``; where that file or line is missing
    (not Linux, some ARM kernels), ``platform.processor()``, else ``platform.machine()``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu


def environment(threads: int) -> dict[str, Any]:
    """The machine a run is on, as the report's header states it: CPU, cores, ``OMP_NUM_THREADS``, the
    torch threads (``threads``), torch and Python versions, and the load average now."""
    import torch

    return {"omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "torch_threads": threads,
            "machine": platform.machine(), "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _describe_environment(env: Optional[dict[str, Any]], threads: int) -> str:
    if env is None:
        return LEGACY_ENVIRONMENT.format(threads=threads)
    load = env.get("load_average")
    return (f"OMP_NUM_THREADS={env['omp_num_threads']}, {env['torch_threads']} torch thread(s), {env['cpu']} "
            f"({env['machine']}, {env['cpu_count']} cores"
            + (f", load average {load:.1f} at the start" if load is not None else "")
            + f"), torch {env['torch']}")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _acc(runs: list[RunResult]) -> Optional[tuple[float, float, int]]:
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
    lo = _acc(by_optimizer.get("logra", []))
    if lo:
        for opt, runs in by_optimizer.items():
            other = _acc(runs)
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


def render_report(cfg: PaperBenchConfig, *, timings: dict[str, float], missing: dict[str, str],
                  memory: list[MemoryRow], planned: list[dict], by_optimizer: dict[str, list[RunResult]],
                  by_rank: dict[int, list[RunResult]], cosines: Optional[dict], kl_rows: list[dict],
                  images: dict[str, str], command: Optional[str] = None,
                  environment: Optional[dict[str, Any]] = None) -> str:
    """The markdown text of the report. ``command`` defaults to :func:`command_line` of ``cfg``;
    ``environment`` is what :func:`environment` recorded (None: a report from before it was recorded,
    described as :data:`LEGACY_ENVIRONMENT`)."""
    cmd = command if command is not None else command_line(cfg)
    budget = "quick" if cfg.quick else "full"
    if report_stem(cfg) in ("results", "results-quick"):
        scope = f"{budget} run"
    else:
        scope = f"{budget} budget, " + (f"{', '.join(f for f in FIGURES if f in cfg.figures)} only"
                                       if set(cfg.figures) != set(FIGURES) else "all figures")
        scope += ", settings changed: see the command" if _is_custom(cfg) else ""
    parts = [f"# Paper figures at small scale ({scope})", "",
             f"Command: `{cmd}` ({_describe_environment(environment, cfg.threads)}). Total wall time "
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
            a = _acc(runs)
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
    :func:`report_stem` (``results``, ``results-quick``, ``results-cosine``, ...): a quick, partial or
    custom run never overwrites the full report."""
    out = Path(cfg.out_dir)
    (out / "results").mkdir(parents=True, exist_ok=True)
    stem = report_stem(cfg)
    path = out / f"{stem}.md"
    path.write_text(text)
    (out / "results" / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    logger.info("wrote %s", path)
    return path
