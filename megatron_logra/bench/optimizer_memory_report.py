"""Tables and verdicts of ``benchmarks/optimizer_memory.py``: the per-size ratios to dense AdamW, the
targets each row is judged against, and the markdown report. Pure functions of the raw measurements
(the JSON the benchmark writes), so ``--render`` re-renders a stored run without measuring."""

from __future__ import annotations

import statistics

OPTIMIZERS = ("adam", "logra_fp32", "logra_bf16")
LABELS = {
    "adam": "dense AdamW (bf16 w, fp32 grad/master/moments)",
    "logra_fp32": "LoGRA fp32 masters",
    "logra_bf16": "LoGRA bf16-only",
}
SHORT = {"adam": "dense AdamW", "logra_fp32": "LoGRA fp32-master", "logra_bf16": "LoGRA bf16"}

# Targets: persistent bytes per target parameter, peak and step time vs dense.
PERSISTENT_TARGET = {"adam": 18.0, "logra_fp32": 6.3, "logra_bf16": 2.3}
PEAK_TARGET = 0.45
TIME_TARGET = 0.85
GATE_HIDDEN = 1024  # peak and step-time targets are judged at hidden >= 1024

MiB = 1024 * 1024


def summarize(raw: dict) -> list[dict]:
    """One row per (size, optimizer): its measurements and ratios to dense AdamW of the same size."""
    rows = []
    for (hidden, layers), res in raw.items():
        dense = res["adam"]
        d_peak = dense["track"]["live_peak_bytes"]
        d_rss = dense["report"]["peak_rss_bytes"]
        d_rss_delta = d_rss - dense["report"]["baseline_rss_bytes"]
        d_time = statistics.median(s["wall_s"] for s in dense["steps"])
        d_cpu = statistics.median(s["cpu_s"] for s in dense["steps"])
        for kind in OPTIMIZERS:
            r = res[kind]
            rep, tr = r["report"], r["track"]
            steps = r["steps"]
            t = statistics.median(s["wall_s"] for s in steps)
            cpu = statistics.median(s["cpu_s"] for s in steps)
            rss_delta = rep["peak_rss_bytes"] - rep["baseline_rss_bytes"]
            row = {
                "hidden": hidden, "layers": layers, "ffn": rep["ffn"], "rank": rep["rank"],
                "model_params": rep["model_params"], "target_params": rep["target_params"],
                "optimizer": kind,
                "persistent_B_per_target_param": rep["persistent_target_B_per_param"],
                "persistent_formula_B_per_target_param": rep["persistent_target_formula_B_per_param"],
                "persistent_target_bytes": rep["persistent_target_bytes"],
                "persistent_model_bytes": rep["persistent_model_bytes"],
                "persistent_model_B_per_param": rep["persistent_model_B_per_param"],
                "opt_persistent_bytes_claimed": rep["opt_persistent_bytes_claimed"],
                "opt_persistent_bytes_measured": rep["opt_persistent_bytes_measured"],
                "native_params": rep["native_params"],
                "peak_breakdown": tr["peak_breakdown"],
                "tracker_num_ops": tr["num_ops"],
                "projection_cache_bytes": rep["projection_cache_bytes"],
                "live_start_bytes": tr["live_start_bytes"],
                "peak_live_bytes": tr["live_peak_bytes"],
                "peak_live_ratio": tr["live_peak_bytes"] / d_peak,
                "peak_phase": tr["peak_phase"],
                "phase_peaks": tr["phase_peaks"],
                "peak_rss_bytes": rep["peak_rss_bytes"],
                "rss_reset_after_build": rep["rss_reset_after_build"],
                "lifetime_peak_rss_bytes": max(rep["peak_rss_bytes"], rep["build_peak_rss_bytes"]),
                "peak_rss_ratio": rep["peak_rss_bytes"] / d_rss,
                "baseline_rss_bytes": rep["baseline_rss_bytes"],
                "peak_rss_above_baseline_bytes": rss_delta,
                "peak_rss_above_baseline_ratio": rss_delta / d_rss_delta,
                "step_s_median": t,
                "step_ratio": t / d_time,
                "step_cpu_s_median": cpu,
                "step_cpu_ratio": cpu / d_cpu,
                "steps": steps,
                "warmup": r["warmup"],
                "tracked_step_s": tr["wall_s"],
                "losses": rep["losses"],
            }
            row["verdicts"] = verdicts(row)
            rows.append(row)
    return rows


def _verdict(value: float, target: float, unit: str = "x") -> str:
    if value <= target:
        return f"PASS ({value:.3g}{unit} <= {target:g}{unit}, margin {target - value:.3g}{unit})"
    return f"MISS ({value:.3g}{unit} > {target:g}{unit}, over by {value - target:.3g}{unit} = {100 * (value / target - 1):.0f}%)"


def verdicts(row: dict) -> dict:
    kind = row["optimizer"]
    if kind == "adam":
        return {"persistent": f"reference ({row['persistent_B_per_target_param']:.4g} B measured, "
                              f"{PERSISTENT_TARGET[kind]:g} B expected)"}
    out = {"persistent": _verdict(row["persistent_B_per_target_param"], PERSISTENT_TARGET[kind], " B")}
    gated = row["hidden"] >= GATE_HIDDEN
    suffix = "" if gated else f" [info only: hidden < {GATE_HIDDEN}]"
    out["peak"] = _verdict(row["peak_live_ratio"], PEAK_TARGET) + suffix
    out["peak_rss"] = _verdict(row["peak_rss_above_baseline_ratio"], PEAK_TARGET) + suffix
    out["step_time"] = _verdict(row["step_ratio"], TIME_TARGET) + suffix
    return out


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [
        "size (hidden/layers/params)", "optimizer", "persistent B/target-param (formula)",
        "peak step mem (tracker) MiB", "ratio", "peak RSS of the steps MiB (above baseline)", "RSS ratio (abs / above)",
        "step time s", "ratio (cpu ratio)",
    ]
    body = []
    for r in rows:
        size = f"{r['hidden']}/{r['layers']}/{r['model_params'] / 1e6:.1f}M (targets {r['target_params'] / 1e6:.1f}M, r={r['rank']})"
        body.append([
            size, SHORT[r["optimizer"]],
            f"{r['persistent_B_per_target_param']:.3f} ({r['persistent_formula_B_per_target_param']:.3f})",
            f"{_mib(r['peak_live_bytes'])} [{r['peak_phase']}]",
            f"{r['peak_live_ratio']:.3f}",
            f"{_mib(r['peak_rss_bytes'])} ({_mib(r['peak_rss_above_baseline_bytes'])})",
            f"{r['peak_rss_ratio']:.3f} / {r['peak_rss_above_baseline_ratio']:.3f}",
            f"{r['step_s_median']:.2f}",
            f"{r['step_ratio']:.3f} ({r['step_cpu_ratio']:.3f})",
        ])
    return header, body


def verdict_lines(rows: list[dict]) -> list[str]:
    lines = [
        f"Targets: persistent <= {PERSISTENT_TARGET['logra_fp32']} B/param (fp32 masters), "
        f"<= {PERSISTENT_TARGET['logra_bf16']} B/param (bf16-only) vs {PERSISTENT_TARGET['adam']:g} dense; "
        f"peak step memory <= {PEAK_TARGET}x dense; step time <= {TIME_TARGET}x dense (at hidden >= {GATE_HIDDEN}).",
    ]
    for r in rows:
        head = f"{r['hidden']}/{r['layers']} {SHORT[r['optimizer']]}:"
        v = r["verdicts"]
        lines.append(f"{head} persistent {v['persistent']}")
        if "peak" in v:
            lines.append(f"{' ' * len(head)} peak (tracker) {v['peak']}")
            lines.append(f"{' ' * len(head)} peak (RSS above baseline) {v['peak_rss']}")
            lines.append(f"{' ' * len(head)} step time {v['step_time']}")
    return lines


def verdict_table(rows: list[dict]) -> list[str]:
    """The verdicts as a markdown table."""
    out = [
        "| size | optimizer | persistent B/target-param | peak (tracker) | peak (RSS above baseline) | step time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["verdicts"]
        out.append("| " + " | ".join([
            f"{r['hidden']}/{r['layers']}", SHORT[r["optimizer"]], v["persistent"],
            v.get("peak", "reference"), v.get("peak_rss", "reference"), v.get("step_time", "reference"),
        ]) + " |")
    return out


def detail_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        pt = r["persistent_target_bytes"]
        n = r["target_params"]
        parts = ", ".join(f"{k} {v / n:.3f}" for k, v in pt.items())
        phases = ", ".join(f"{k} {_mib(v)}" for k, v in r["phase_peaks"].items())
        steps = r["steps"]
        med = {k: statistics.median(s[k] for s in steps) for k in ("fwd_bwd_s", "prepare_s", "apply_s")}
        fastest = min(s["wall_s"] for s in steps)
        claimed = ", ".join(f"{k} {v / n:.3f}" for k, v in r["opt_persistent_bytes_claimed"].items())
        measured = ", ".join(f"{k} {v / n:.3f}" for k, v in r["opt_persistent_bytes_measured"].items())
        top = "; ".join(f"{k}: {_mib(v)}" for k, v in list(r["peak_breakdown"].items())[:6])
        lines.append(
            f"{r['hidden']}/{r['layers']} {SHORT[r['optimizer']]}: per target param [{parts}] B; "
            f"whole model persistent {_mib(r['persistent_model_bytes'])} MiB ({r['persistent_model_B_per_param']:.2f} B/param, "
            f"opt.persistent_bytes() [{claimed}] vs the same categories measured [{measured}] bytes per target param; "
            f"live at step start {_mib(r['live_start_bytes'])} MiB; "
            f"phase peaks [{phases}] MiB; largest live groups at the peak (phase op [output shape]: MiB) [{top}]; "
            f"projection cache during the step {r['projection_cache_bytes'] / 1024:,.0f} KiB; "
            f"tracked step {r['tracked_step_s']:.2f} s ({r['tracker_num_ops']} ops); "
            f"step phases (median s) fwd+bwd {med['fwd_bwd_s']:.2f}, prepare {med['prepare_s']:.3f}, apply {med['apply_s']:.3f}; "
            f"step times {[round(s['wall_s'], 2) for s in steps]} (min {fastest:.2f}); "
            f"peak RSS over the process life {_mib(r['lifetime_peak_rss_bytes'])} MiB; losses {[round(x, 3) for x in r['losses']]}"
        )
    return lines


def _machine(meta: dict) -> str:
    """Where the run was measured, from its record (runs recorded before the CPU was kept say so)."""
    if "cpus" not in meta:
        return "(machine not recorded)."
    return f"on {meta['cpus']} CPUs ({meta.get('cpu', 'model not recorded')})."


def markdown(rows: list[dict], meta: dict) -> str:
    header, body = table_rows(rows)
    out = [
        "# Optimizer memory and step time: dense AdamW vs LoGRA",
        "",
        f"Command: `{meta['command']}`  ",
        f"Run: {meta['date']}, {meta['runtime_s']:.0f} s, torch {meta['torch']}, {meta['threads']} threads, "
        f"micro-batch {meta['micro_batch']} x seq {meta['seq']}, vocab {meta['vocab']}, bf16 weights, rank r = hidden/16, "
        f"{meta['steps']} timed steps per configuration (median), interleaved round-robin. "
        + ("Child processes reused across sizes (RSS baseline of a size = RSS after the previous size was freed). "
           if meta["reuse_processes"] else "Fresh child processes per size. ")
        + f"Load average (1 min) at start / end: {meta['load_avg_start'][0]:.1f} / {meta['load_avg_end'][0]:.1f} "
        + _machine(meta),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    out += ["", "## Targets", "", verdict_lines(rows)[0], "", *verdict_table(rows)]
    out += ["", "## Details", ""] + [f"- {line}" for line in detail_lines(rows)]
    out += ["", "## How measured", "", *[f"- {line}" for line in meta["notes"]], ""]
    return "\n".join(out)


NOTES = [
    "persistent B/target-param: bytes of the objects that live across steps for the target linears "
    "(linear_qkv/proj/fc1/fc2) — weight, fp32 main_grad, master, Adam moments (dense); weight, fp32 master, "
    "sketch rows, row moments (LoGRA) — read from the tensors after the steps, divided by the target "
    "parameter count. In parentheses: the formula (18; 2 + 4 + Σn_out(4r + 4)/Σn_out·n_in; 2 + Σn_out(4r + 4)/Σn_out·n_in).",
    "peak step mem (tracker): maximum of live tensor bytes (whole process: weights, optimizer state, activations, "
    "temporaries) over one full step (zero_grad, forward, backward, prepare, apply) after a warm-up step; the "
    "phase of the peak in brackets. A TorchDispatchMode registers each storage returned by an op once; "
    "weakref.finalize on the storage removes it; every tensor alive at the start is registered too.",
    "peak RSS of the steps: ru_maxrss of the configuration's own child process, reset (/proc/self/clear_refs) "
    "after the model and optimizer are built, read after the warm-up, tracked and timed steps; in parentheses "
    "the part above the baseline RSS measured before the model is built (after imports and process-group init "
    "in a fresh child; after freeing the previous size when children are reused, as with --quick), so it holds "
    "weights, optimizer state, activations, temporaries and allocator overhead. RSS ratio: absolute / above "
    "the baseline, each vs dense.",
    "step time: median wall time of the timed steps (each: zero_grad, forward+backward, prepare, apply), "
    "commanded round-robin across the three configurations; cpu ratio: the same with process CPU time.",
    "The whole model includes embeddings, norms and the output layer (native AdamW in every configuration); the "
    "per-target figures exclude them.",
]


def print_table(rows: list[dict]) -> None:
    header, body = table_rows(rows)
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="Optimizer memory / step time (ratios vs dense AdamW of the same size)")
        for h in header:
            table.add_column(h, overflow="fold")
        prev = None
        for r, row in zip(rows, body):
            key = (r["hidden"], r["layers"])
            if prev is not None and key != prev:
                table.add_section()
            prev = key
            table.add_row(*(escape(c) for c in row))
        Console(width=200).print(table)
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)]
        print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
        print("-+-".join("-" * w for w in widths))
        for row in body:
            print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))
