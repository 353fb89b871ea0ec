"""What the policy generated, for reading: ``RUN/samples.jsonl`` (``rl.log_samples``), as verl's logged generations
and slime's saved rollout data let one read a run's answers.

Contract: one JSON object per line, written by global rank 0 only. ``split`` is ``"train"`` (the step's rollouts:
the first ``rl.log_samples`` of DP rank 0's batch, after the reward and the advantage) or ``"eval"`` (a held-out
evaluation's completions of DP rank 0's first ``rl.log_samples`` problems; ``step`` 0 is the one before training).
Each record holds ``step``, ``split``, ``source``, ``id`` (the problem's id or file line, when it has one),
``prompt`` (the problem's text, without the template), ``completion`` (decoded, without stop tokens), ``answer``
(the gold one), ``reward``, ``correct``, ``completion_tokens``, ``finished`` (a stop token ended it) and, for
``train``, ``advantage``. A resume drops the records of steps after its checkpoint (:func:`keep_records_until`),
and :meth:`SampleLog.sync` makes the file durable with each checkpoint, as for ``metrics.jsonl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_logra.metrics import SAMPLES_FILE, is_rank0, keep_records_until, strict_dumps

__all__ = ["SAMPLES_FILE", "SampleLog", "sample_records"]


def _problem_id(problem: Any) -> Any:
    meta = problem.metadata
    for key in ("id", "unique_id", "line", "source_index"):
        if meta.get(key) is not None:
            return meta[key]
    return None


def sample_records(step: int, split: str, problems: Sequence[Any], completions: Sequence[str],
                   rollouts: Sequence[Any], scored: Sequence[tuple[float, bool]],
                   advantages: Optional[Sequence[float]] = None) -> list[dict]:
    """The records of the samples ``completions`` holds (the first ones of the other lists): ``problems[i]``
    answered by ``completions[i]`` (``rollouts[i]``'s decoded text), scored ``scored[i] = (reward, correct)``, with
    ``advantages[i]`` for training samples (see the module doc)."""
    out = []
    for i in range(len(completions)):
        problem, rollout, (reward, correct) = problems[i], rollouts[i], scored[i]
        record = {"step": step, "split": split, "source": problem.source, "id": _problem_id(problem),
                  "prompt": problem.prompt, "completion": completions[i], "answer": problem.answer,
                  "reward": float(reward), "correct": bool(correct),
                  "completion_tokens": len(rollout.completion_ids), "finished": bool(rollout.finished)}
        if advantages is not None:
            record["advantage"] = float(advantages[i])
        out.append(record)
    return out


class SampleLog:
    """Appends :func:`sample_records` to ``RUN/samples.jsonl`` on global rank 0 (a no-op elsewhere)."""

    def __init__(self, run_dir: str | Path, limit: int, *, truncate_after: Optional[int] = None,
                 table: Optional[Callable[[str, int, list[dict]], None]] = None) -> None:
        """``limit``: ``rl.log_samples``. ``truncate_after``: a resume's checkpoint step (records after it are
        dropped); None: a new run (an old file is removed). ``table(name, step, rows)``: also gets each write, one
        table per split and step (``samples/train``, ``samples/eval``; the job passes
        :meth:`~megatron_logra.metrics.MetricsWriter.log_table`, which logs it to W&B)."""
        self.limit = limit
        self.table = table
        self.enabled = is_rank0()
        self.path = Path(run_dir) / SAMPLES_FILE
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after is not None:
            keep_records_until(self.path, truncate_after)
        elif self.path.exists():
            self.path.unlink()

    def write(self, records: Sequence[dict]) -> None:
        if not self.enabled or not records:
            return
        with self.path.open("a") as fh:
            fh.write("".join(strict_dumps(record, ensure_ascii=False) + "\n" for record in records))
        if self.table is not None:
            self.table(f"samples/{records[0]['split']}", records[0]["step"], list(records))

    def sync(self) -> None:
        """Flush the file to storage (before a checkpoint save)."""
        if self.enabled and self.path.exists():
            from megatron_logra.checkpoint.durable import fsync_path

            fsync_path(self.path)
