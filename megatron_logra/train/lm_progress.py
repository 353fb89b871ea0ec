"""The LM job's progress and summary: the live progress bar, the losses a resumed run reads back from its
``metrics.jsonl``, and the whole-run summary :func:`megatron_logra.train.lm.run_lm` returns and writes to
``RUN/summary.json``.

Kept apart from the loop so ``run_lm`` reads as the training story; what the summary holds after a resume
(steps of earlier processes included) is stated once, in :func:`run_summary`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from megatron_logra.config import RunConfig
from megatron_logra.metrics import is_rank0, json_safe

logger = logging.getLogger(__name__)

__all__ = ["recorded_losses", "start_progress", "run_summary"]


def recorded_losses(path: Path, steps: tuple[int, ...]) -> dict[int, Optional[float]]:
    """The ``loss`` of each of ``steps`` that ``path`` (a run's ``metrics.jsonl``) records, by step; a
    recorded non-finite loss (``null``) is None, and a step without a record is absent. The file is read line
    by line; a line that is not a JSON step record (a torn last line of a killed run) is skipped, as
    resuming drops it."""
    wanted, found = set(steps), {}
    try:
        with path.open() as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, int) and not isinstance(step, bool) and step in wanted:
                    loss = record.get("loss")
                    numeric = isinstance(loss, (int, float)) and not isinstance(loss, bool)
                    found[step] = float(loss) if numeric else None
    except FileNotFoundError:
        if is_rank0():
            logger.warning("%s does not exist: the summary's losses of the steps before this resume are null",
                           path)
    return found



def start_progress(cfg: RunConfig, start: int) -> tuple[Any, Any]:
    """Start a ``rich`` progress bar over ``train.steps`` (``start`` of them already done) and return it with its
    task id; the loop advances it once per step with the step's ``loss`` and ``gnorm``. ``rich`` is imported
    here, only by a run that shows the bar (rank 0, ``train.progress``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("|g| {task.fields[gnorm]:.2f}"),
        TimeElapsedColumn(), transient=False,
    )
    task_id = progress.add_task("train", total=cfg.train.steps, completed=start, loss=float("nan"), gnorm=float("nan"))
    progress.start()
    return progress, task_id


def run_summary(cfg: RunConfig, *, first_loss: Optional[float], last_loss: Optional[float],
                eval_before_run: Optional[float], eval_after: Optional[float], steps: int, stopped: Optional[str],
                start: int, eval_before: float, train_seconds: float) -> dict:
    """The run's summary, JSON-safe (a loss that is not finite, a diverged or overflowed run, is None, as
    ``null`` in ``metrics.jsonl``). It describes the whole run, also after ``--resume`` (the steps of earlier
    processes are read from ``RUN/metrics.jsonl`` and the previous ``summary.json``):

    * ``steps`` — the run's last step (every step of the run, whichever process trained it).
    * ``first_loss`` / ``last_loss`` — the training loss of step 1 / of step ``steps``; a step trained by an
      earlier process is read from its ``metrics.jsonl`` record (None when that record is missing).
    * ``eval_loss_before`` — held-out loss before step 1: measured by a run that starts at step 0, carried
      over from the previous ``summary.json`` by a resumed one, or from ``RUN/eval_before.json``, which the run
      that started at step 0 writes as soon as it has measured it (None when neither has it).
      ``eval_loss_after`` — held-out loss after step ``steps`` (None for a run stopped early).
      ``chance_loss`` — ``ln(data.num_symbols)``.
    * ``stopped`` — why this process stopped early (None: it reached ``train.steps``).
    * This process only: ``resumed_from_step`` (the checkpoint's step it started from, 0 for a new run),
      ``segment_steps`` (the steps it trained, ``steps - resumed_from_step``), ``segment_eval_loss_before``
      (held-out loss at ``resumed_from_step``) and ``segment_train_seconds`` (wall time of its training loop).

    A resume with ``train.steps`` equal to the latest checkpoint's step trains nothing and writes the same
    whole-run summary again (``segment_steps`` 0)."""
    return json_safe({
        "optimizer": cfg.optimizer.name,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "eval_loss_before": eval_before_run,
        "eval_loss_after": eval_after,
        "chance_loss": math.log(cfg.data.num_symbols),
        "steps": steps,
        "stopped": stopped,
        "resumed_from_step": start,
        "segment_steps": steps - start,
        "segment_eval_loss_before": eval_before,
        "segment_train_seconds": train_seconds,
    })
