"""The values a run measured before its first step, kept across processes: ``RUN/eval_before.json`` and the
previous ``summary.json`` a resumed job reads its whole-run figures from (the held-out score before training, the
time totals of earlier processes)."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Optional

from megatron_logra.metrics import is_rank0, strict_dumps

__all__ = ["BEFORE_FILE", "previous_summary_values", "record_before_values"]

BEFORE_FILE = "eval_before.json"
"""The file in a run directory that holds the values a run measured before step 1 (the held-out score then), written
as soon as they are measured (:func:`record_before_values`): a run killed before it writes ``summary.json`` keeps
them, and a resumed run's summary still reports them (:func:`previous_summary_values`)."""


def previous_summary_values(path: Path, start: int, carried: tuple[str, ...],
                            if_ending_here: tuple[str, ...] = ()) -> dict[str, float]:
    """The numbers a resumed job (at step ``start`` > 0) carries over from the run's previous ``summary.json``
    (``path``) into its whole-run summary: ``carried`` (values measured before step 1, e.g. the held-out score
    then; a name may be a pattern, ``"eval_accuracy_before/*"`` for the score of every source) and, only when that summary ends at ``start`` (so it accounts for every earlier process),
    ``if_ending_here`` (totals the new summary adds to). A value that is missing, ``null`` or not a number is
    absent; a missing, torn or non-object file gives ``{}``. A summary without ``resumed_from_step`` (written
    when summaries described one process) counts only when it ends at ``start``: only then did its process
    start at step 0. A ``carried`` value the summary does not give (no summary yet: every earlier process was
    killed before writing one) comes from ``BEFORE_FILE`` beside it, which the run that started at step 0
    wrote as soon as it measured the value (:func:`record_before_values`)."""
    before = {k: v for k, v in _read_numbers(path.with_name(BEFORE_FILE)).items() if _named(k, carried)}
    previous = _read_object(path)
    if previous is None:
        return before
    ends_here = _number(previous.get("steps")) == start
    if "resumed_from_step" not in previous and not ends_here:
        return before
    keys = carried + (if_ending_here if ends_here else ())
    return {**before, **{k: _number(v) for k, v in previous.items() if _named(k, keys) and _number(v) is not None}}


def _named(key: str, names: tuple[str, ...]) -> bool:
    return any(fnmatchcase(key, name) if "*" in name else key == name for name in names)


def record_before_values(run_dir: str | Path, values: dict[str, Optional[float]]) -> None:
    """Write ``values`` (measured before step 1 by a run that starts at step 0, e.g. ``{"eval_accuracy_before":
    0.31}``; None for one not measured) to ``RUN_DIR/`` :data:`BEFORE_FILE` at once, replacing the file atomically
    (a kill leaves the old file or the new one). :func:`previous_summary_values` falls back to them for its
    ``carried`` values, so a run killed before its first ``summary.json`` does not lose them. Rank 0 writes; the
    other ranks do nothing."""
    if not is_rank0():
        return
    from megatron_logra.checkpoint.integrity import atomic_write_text

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / BEFORE_FILE, strict_dumps(values, indent=1))


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _read_object(path: Path) -> Optional[dict]:
    """The JSON object in ``path``; None for a missing, torn or non-object file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_numbers(path: Path) -> dict[str, float]:
    """The numeric values of the JSON object in ``path`` (``{}`` for a missing, torn or non-object file)."""
    data = _read_object(path) or {}
    return {k: _number(v) for k, v in data.items() if _number(v) is not None}
