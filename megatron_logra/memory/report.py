"""Tables of memory plans: rich tables for the terminal, markdown for docs. Nothing here prints."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

from megatron_logra.memory.count import count_params
from megatron_logra.memory.breakdown import MemoryPlan
from megatron_logra.memory.units import format_bytes

logger = logging.getLogger(__name__)

__all__ = ["LABELS", "Scenario", "breakdown_rows", "breakdown_table", "summary_rows", "summary_table", "markdown",
           "layout_text", "verdict_line"]

LABELS = {"adam": "dense AdamW", "logra": "LoGRA"}


@dataclass
class Scenario:
    """One planned case: a model on a GPU, with its plans (one per optimizer, dense first)."""

    model_name: str
    """Preset name or config path as given."""
    gpu_text: str
    """GPU memory as given on the command line (e.g. 80GiB)."""
    plans: tuple[MemoryPlan, ...]
    """The plans of this case (one per optimizer)."""


def _label(p: MemoryPlan) -> str:
    c = p.config
    # the distributed optimizer changes the plan at any DP size (at DP 1 its fused step has no foreach or
    # grad-norm temporaries), so a plan of it is always labelled as one
    if c.optimizer == "adam":
        return LABELS["adam"] + (" (dist. opt.)" if c.distributed_optimizer else "")
    return (f"{LABELS['logra']} r={c.rank}" + (", bf16-only" if c.masters == "none" else "")
            + (", dist. opt." if c.distributed_optimizer else ""))


def layout_text(p: MemoryPlan) -> str:
    c = p.config
    return (f"TP{c.tp} PP{c.pp} DP{c.dp}, micro-batch {c.micro_batch} x {c.seq_len}, recompute {c.recompute}, "
            f"{c.attention} attention, engine {c.engine_fraction:g}")


def verdict_line(p: MemoryPlan) -> str:
    w = p.worst
    stage = f" (pipeline stage {w.stage})" if p.config.pp > 1 else ""
    return (f"{_label(p)}: {p.verdict} — {format_bytes(w.total)} of "
            f"{format_bytes(p.gpu_memory)} on the worst rank{stage}; trainer peak {format_bytes(w.trainer_peak)}")


def _fraction(limit: float) -> str:
    """An engine-fraction limit as the table shows it: ``none`` when even no engine at all leaves that much free
    (the limit is negative; a fraction below 0 is no setting), else two decimals, rounded down so that the
    fraction shown keeps the promise (0.068 shows as 0.06, never as 0.07)."""
    if limit < 0:
        return "none"
    return f"{math.floor(limit * 100) / 100:.2f}"


def breakdown_rows(plans: Sequence[MemoryPlan]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one line per memory item, one column per plan (its worst rank). Under pipeline
    parallelism the header names each column's stage: the worst stages of two plans may differ (dense AdamW's
    last stage with the logits beside LoGRA's first stage with the most micro-batches in flight)."""
    header = ["per rank"] + [_label(p) + (f" (pipeline stage {p.worst.stage})" if p.config.pp > 1 else "")
                             for p in plans]
    ranks = [p.worst for p in plans]
    rows = []
    for i, (name, _) in enumerate(ranks[0].items()):
        rows.append([name] + [format_bytes(r.items()[i][1]) for r in ranks])
    rows.append(["persistent state"] + [format_bytes(r.persistent) for r in ranks])
    rows.append(["trainer peak"] + [format_bytes(r.trainer_peak) for r in ranks])
    rows.append(["policy-sync peak"] + [format_bytes(r.sync_peak) for r in ranks])
    if any(r.rollout_working for r in ranks):
        rows.append(["embedded-rollout peak"] + [format_bytes(r.rollout_peak) for r in ranks])
    rows.append(["total"] + [format_bytes(r.total) for r in ranks])
    rows.append(["GPU memory"] + [format_bytes(p.gpu_memory) for p in plans])
    rows.append(["verdict"] + [p.verdict for p in plans])
    rows.append(["max engine fraction: fit / >=15% free"]
                + [f"{_fraction(p.engine_fraction_limit(0.0))} / {_fraction(p.engine_fraction_limit(0.15))}"
                   for p in plans])
    return header, rows


def breakdown_table(plans: Sequence[MemoryPlan], title: str):
    """A ``rich.table.Table`` of :func:`breakdown_rows`."""
    from rich.table import Table

    header, rows = breakdown_rows(plans)
    table = Table(title=title, title_justify="left")
    table.add_column(header[0])
    for h in header[1:]:
        table.add_column(h, justify="right")
    n_items = len(plans[0].worst.items())
    for i, row in enumerate(rows):
        if i == n_items:
            table.add_section()
        style = None
        if row[0] == "verdict":
            style = "bold"
        table.add_row(*[_colour(c) if row[0] == "verdict" else c for c in row], style=style)
    return table


def _colour(text: str) -> str:
    if text.startswith("fit"):
        return f"[green]{text}[/green]"
    if text.startswith("OOM"):
        return f"[red]{text}[/red]"
    return text


def summary_rows(scenarios: Sequence[Scenario]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one line per (model, GPU); total and verdict of every optimizer."""
    labels = [_label(p) for p in scenarios[0].plans]
    header = ["model", "params (per rank)", "GPU", "layout"]
    for lab in labels:
        header += [f"{lab} total", f"{lab} verdict"]
    rows = []
    for sc in scenarios:
        p0 = sc.plans[0]
        c = p0.config
        total_params = count_params(p0.model).total
        per_rank = max(s.counts.total for s in p0.stages)
        row = [sc.model_name, f"{total_params / 1e9:.2f} B ({per_rank / 1e9:.2f} B)", format_bytes(p0.gpu_memory),
               f"TP{c.tp} PP{c.pp} DP{c.dp}"]
        for p in sc.plans:
            row += [format_bytes(p.worst.total), p.verdict]
        rows.append(row)
    return header, rows


def summary_table(scenarios: Sequence[Scenario], title: str):
    """A ``rich.table.Table`` of :func:`summary_rows`."""
    from rich.table import Table

    header, rows = summary_rows(scenarios)
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i >= 4 else "left")
    for row in rows:
        table.add_row(*[_colour(c) if "verdict" in header[i] else c for i, c in enumerate(row)])
    return table


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)
