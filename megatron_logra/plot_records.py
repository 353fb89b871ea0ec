"""The values a plot of a run draws from its records: a field's finite series, and the held-out values the run's
``summary.json`` adds around the step records.

:func:`finite_series` is a field's ``(steps, values)`` where it holds a finite number. :func:`held_out_before` is a
step-0 record with the held-out value before training (``eval_accuracy_before`` / ``eval_loss_before``, per source
too) and :func:`held_out_after` the final evaluation's values (``eval_*_after``) that the last step's record lacks;
both read ``RUN_DIR/summary.json`` and give nothing when it is missing, unreadable or does not match the records.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

__all__ = ["finite_series", "held_out_after", "held_out_before"]


def finite_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The steps and values of field ``key`` in ``records`` where it holds a finite number (null, NaN,
    ±Infinity, a bool or a missing field: no point)."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)  # NaN / ±Infinity (not written by the jobs, which write null): no value, as null
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


_BEFORE = {"eval_accuracy": "eval_accuracy_before", "eval_loss": "eval_loss_before"}
"""The held-out field of the step records -> the summary field holding its value before training."""


def held_out_before(run_dir: str | Path, records: list[dict]) -> Optional[dict]:
    """A step-0 record with the held-out value before training from ``RUN_DIR/summary.json`` (the field of
    :data:`_BEFORE` of the run's job: RL when a record has ``reward_mean``); None when the file is missing or
    unreadable, holds no such number, or ``records`` already have a step 0."""
    if any(r["step"] == 0 for r in records):
        return None
    key = "eval_accuracy" if any("reward_mean" in r for r in records) else "eval_loss"
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    value = summary.get(_BEFORE[key])
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    prefix = _BEFORE[key] + "/"  # per source: eval_accuracy_before/gcd -> eval_accuracy/gcd
    return {"step": 0, key: float(value), **{f"{key}/{k[len(prefix):]}": float(v) for k, v in summary.items()
                                             if k.startswith(prefix) and finite_series([{"step": 0, "v": v}], "v")[0]}}


def _held_out_field(name: str) -> Optional[str]:
    """The record's field of a summary's final held-out value: ``eval_loss_after`` -> ``eval_loss``,
    ``eval_accuracy_after/gcd`` -> ``eval_accuracy/gcd``, ``eval_pass_at_k_after`` -> ``eval_pass_at_k``."""
    for field in ("eval_loss", "eval_accuracy", "eval_pass_at_k"):
        if name == f"{field}_after" or name.startswith(f"{field}_after/"):
            return field + name[len(field) + len("_after"):]
    return None


def held_out_after(run_dir: str | Path, records: list[dict]) -> dict:
    """The final evaluation's values (``summary.json``'s ``eval_*_after``) that the last step's record lacks
    (its step is no multiple of the eval interval), under the record's names; empty unless the summary ends
    at the records' last step."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    last = records[-1]
    if not isinstance(summary, dict) or summary.get("steps") != last["step"] or summary.get("stopped"):
        return {}
    after = {}
    for name, value in summary.items():
        field = _held_out_field(name)
        if field and finite_series([{"step": 0, "v": value}], "v")[0] and not finite_series([last], field)[0]:
            after[field] = float(value)
    return after
