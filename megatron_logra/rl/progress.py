"""The RL job's summary and progress helpers: what an earlier process of a resumed run reported, the whole
run's times, the resident memory of each record and the progress bar."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from megatron_logra.config import RunConfig
from megatron_logra.run_summary import previous_summary_values

__all__ = ["BEFORE_FIELDS", "previous_summary", "run_total", "rss_bytes", "bar_fields", "progress_bar"]


BEFORE_FIELDS = ("eval_accuracy_before", "eval_accuracy_before/*", "eval_pass_at_k_before")
"""The summary's held-out values before update 1: overall, per source (a mixture or ``task.eval_datasets``) and
pass@k; kept in ``eval_before.json`` and carried into a resumed run's summary."""


def previous_summary(path: Path, start: int) -> dict:
    """What the run's previous ``summary.json`` (``path``) says about the run before step ``start`` (the step
    this process resumed from): ``eval_accuracy_before`` (the held-out accuracy before update 1), its value per
    source (``eval_accuracy_before/SOURCE``) and ``eval_pass_at_k_before``, and, when that
    summary ends at ``start``, ``setup_seconds`` / ``rl_seconds`` / ``total_seconds``
    (:func:`~megatron_logra.run_summary.previous_summary_values`)."""
    return previous_summary_values(path, start, BEFORE_FIELDS,
                                   ("setup_seconds", "rl_seconds", "total_seconds"))


def run_total(previous: dict, key: str, segment: float, start: int) -> Optional[float]:
    """The whole run's ``key`` time: this process's ``segment`` plus the earlier processes' (``previous``);
    None when a resumed run (``start`` > 0) does not know the earlier ones'."""
    if not start:
        return segment
    return previous[key] + segment if key in previous else None


def rss_bytes() -> int:
    """This process's resident memory in bytes (0 without ``psutil``)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0


def bar_fields(record: dict) -> dict:
    """The progress bar's fields of an update's record (NaN for a value not measured)."""
    def f(key):
        v = record.get(key)
        return float("nan") if v is None else float(v)

    return {"reward": f("reward_mean"), "acc": f("accuracy"), "kl_pred": f("kl_predicted"),
            "kl_act": f("kl_actual"), "alpha": f("alpha")}


def progress_bar(cfg: RunConfig, start: int):
    """A started ``rich`` progress bar over ``rl.steps`` from ``start`` and its task id."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]rl[/bold]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f} acc {task.fields[acc]:.2f}"),
        TextColumn("KL pred/act {task.fields[kl_pred]:.2e}/{task.fields[kl_act]:.2e} α {task.fields[alpha]:.2f}"),
        TimeElapsedColumn(),
    )
    task_id = progress.add_task("rl", total=cfg.rl.steps, completed=start, reward=math.nan, acc=math.nan,
                                kl_pred=math.nan, kl_act=math.nan, alpha=math.nan)
    progress.start()
    return progress, task_id
