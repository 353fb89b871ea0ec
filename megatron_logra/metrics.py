"""Metrics: one JSON object per step in ``metrics.jsonl`` plus TensorBoard events, rank 0 only."""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_logra.wandb_log import WandbOptions

logger = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "closing_metrics_on_error", "is_rank0", "log_rank0", "reset_device_peaks", "device_peaks", "max_over_ranks", "elapsed",
           "json_safe", "strict_dumps", "SAMPLES_FILE", "keep_records_until"]

SAMPLES_FILE = "samples.jsonl"
"""The file in a run directory that holds the rollouts and held-out answers ``rl.log_samples`` logs
(:mod:`megatron_logra.rl.sample_log`)."""

def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(msg: str, *args: Any) -> None:
    if is_rank0():
        logger.info(msg, *args)


def reset_device_peaks(device: torch.device) -> None:
    """Start a new peak-memory window on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def elapsed(t0: float, device: torch.device) -> float:
    """Seconds since ``time.perf_counter()`` returned ``t0``, once the work queued on ``device`` has finished:
    on CUDA the step's last kernels (the weight merges) still run when the host is done, and would otherwise
    count towards the next step's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def max_over_ranks(values: dict[str, Optional[int]], group: Optional[dist.ProcessGroup] = None
                   ) -> dict[str, Optional[int]]:
    """The largest of each value (a non-negative int, or None) over the ranks of ``group`` (default: every
    rank), None where no rank has one. A collective (one all-reduce MAX): every rank of the group calls it
    with the same keys in the same order. Without a process group, or in a group of one, ``values`` as
    they are."""
    if not dist.is_initialized():
        return dict(values)
    group = group if group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return dict(values)
    from megatron_logra.parallel import collective_device

    for key, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"max_over_ranks: {key}={value!r} must be a non-negative int or None")
    packed = torch.tensor([-1 if v is None else v for v in values.values()], dtype=torch.int64,
                          device=collective_device(group))
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return {key: None if peak < 0 else int(peak) for key, peak in zip(values, packed.tolist())}


def device_peaks(device: torch.device) -> dict[str, Optional[int]]:
    """The step's accelerator memory peaks since :func:`reset_device_peaks`, the largest over all ranks
    (:func:`max_over_ranks`; under pipeline parallelism the last stage, which holds the logits, often has
    them): bytes held by tensors (``gpu_memory_peak_bytes``) and reserved by the caching allocator
    (``gpu_memory_reserved_peak_bytes``, what ``nvidia-smi`` sees). On CUDA a collective that every rank
    calls at the same point; off CUDA (every rank on the host) both are None and nothing is exchanged."""
    if device.type != "cuda":
        return {"gpu_memory_peak_bytes": None, "gpu_memory_reserved_peak_bytes": None}
    return max_over_ranks({"gpu_memory_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                           "gpu_memory_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(device))})


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf), at any depth of dicts / lists / tuples, replaced by
    None: what strict JSON can hold (``null``), as ``metrics.jsonl`` writes a diverged step's loss."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return _clean(value)


def strict_dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`json_safe` ``(value)`` with ``allow_nan=False``: standard JSON (no bare ``NaN`` /
    ``Infinity``, which jq, JavaScript and strict parsers reject), for every file a run writes and every JSON
    the command line prints."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def _step_of(line: str, last: int) -> bool:
    """Keep ``line`` when it is a record of a step <= ``last`` (a torn final line of a killed run is dropped)."""
    if not line.strip():
        return False
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        logger.warning("dropping a torn metrics record (the previous run was killed while writing it)")
        return False
    return isinstance(record, dict) and record.get("step", 0) <= last


def keep_records_until(path: Path, last: int) -> None:
    """Drop the records of steps after ``last`` (a resume's checkpoint step) from the JSON-lines file ``path``, so
    that it matches an uninterrupted run; a torn final line of a killed run goes too. Replaced atomically and
    durably (a crash leaves the old file or the new one); a missing file stays missing."""
    if not path.exists():
        return
    from megatron_logra.checkpoint.durable import atomic_write_text

    kept = [line for line in path.read_text().splitlines() if _step_of(line, last)]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


TEXT_FIELDS = ("skip_reason",)
"""Record fields written to TensorBoard as text (at the steps where they hold a string): why a step applied no
update. Other strings (``sync_mode``) are the same at most steps and stay in ``metrics.jsonl`` only."""


class MetricsWriter:
    """Appends step records to ``RUN/metrics.jsonl`` and TensorBoard (if installed) on rank 0."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, truncate_after: Optional[int] = None,
                 wandb: Optional[WandbOptions] = None) -> None:
        """``truncate_after``: a resume's checkpoint step (records after it are dropped); None: a new run.
        ``wandb``: also log to Weights & Biases (:mod:`megatron_logra.wandb_log`; the package must be installed,
        which :func:`~megatron_logra.wandb_log.check_wandb` checks on every rank before the job builds anything)."""
        self.enabled = is_rank0()
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if self.enabled:
            self._open(tensorboard, truncate_after)
        if wandb is not None:
            self._start_wandb(wandb, resume=truncate_after is not None)

    def _open(self, tensorboard: bool, truncate_after: Optional[int]) -> None:
        _open_writers.append(self)  # closed as failed if the job raises (:func:`closing_metrics_on_error`)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after is not None:
            keep_records_until(self.path, truncate_after)
        elif self.path.exists():
            self.path.unlink()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # resuming: TensorBoard drops the points after the checkpoint (purge_step) as metrics.jsonl does
                purge = truncate_after + 1 if truncate_after is not None else None
                self._tb = SummaryWriter(log_dir=str(self.path.parent / "tensorboard"), purge_step=purge)
            except ImportError:
                logger.info("tensorboard is not installed; writing metrics.jsonl only")

    def _start_wandb(self, options: WandbOptions, *, resume: bool) -> None:
        """Rank 0 starts the W&B run; every rank of a launch learns whether that failed and raises the same
        ``ValueError`` (the others would otherwise go on into the job's next collective and wait there)."""
        from megatron_logra.wandb_log import WandbRun

        error = ""
        if self.enabled:
            try:
                self._wandb = WandbRun(self.path.parent, options, resume=resume)
            except ValueError as exc:
                error = str(exc)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megatron_logra.parallel import all_gather_bytes

            error = next((e.decode() for e in all_gather_bytes(error.encode(), dist.group.WORLD) if e), "")
        if error:
            self.close(failed=True)
            raise ValueError(error)

    def write_before(self, values: dict[str, Optional[float]]) -> None:
        """The held-out value measured before the first step (``{"eval_accuracy": 0.035}``) as step 0 of the
        TensorBoard and W&B charts, so that a chart starts where training did. ``metrics.jsonl`` holds step
        records only (``summary.json`` and ``eval_before.json`` keep this value); None values are left out."""
        if not self.enabled:
            return
        values = {k: v for k, v in json_safe(values).items() if v is not None}
        if not values:
            return
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, 0)
        if self._wandb is not None:
            self._wandb.log({"step": 0, **values})

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = json_safe(record)
        with self.path.open("a") as fh:
            fh.write(strict_dumps(record) + "\n")
        if self._tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k == "step":
                    continue
                if isinstance(v, bool):  # a flag (``skipped``) is a 0/1 series, to see when it was set
                    self._tb.add_scalar(k, int(v), step)
                elif isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
                elif isinstance(v, str) and k in TEXT_FIELDS:
                    self._tb.add_text(k, v, step)
        if self._wandb is not None:
            self._wandb.log(record)

    def sync(self) -> None:
        """Flush ``metrics.jsonl`` and the TensorBoard events to storage. The jobs call this before each checkpoint
        save, so that once a checkpoint is on storage so are the records of every step up to it: a run resumed after a
        power loss or a node crash then has no gap in its metrics (records are appended unsynced between saves, and
        those after the checkpoint are dropped by the resume anyway)."""
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.flush()
        if self.path.exists():
            from megatron_logra.checkpoint.durable import fsync_path

            fsync_path(self.path)

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """``rows`` as the W&B table ``name`` at ``step`` when logging to W&B (nothing otherwise, and for no rows):
        the samples :mod:`megatron_logra.rl.sample_log` writes."""
        if self._wandb is not None and rows:
            self._wandb.log_table(name, step, json_safe(rows))

    def close(self, summary: Optional[dict[str, Any]] = None, *, failed: bool = False) -> None:
        """Flush and close TensorBoard and W&B (which gets ``summary``, the run's ``summary.json``, as its
        run summary; ``failed``: the W&B run is marked failed, exit code 1). Closing twice is closing once."""
        if self in _open_writers:
            _open_writers.remove(self)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            wandb_run, self._wandb = self._wandb, None
            wandb_run.close(json_safe(summary) if summary else None, exit_code=1 if failed else 0)


_open_writers: list[MetricsWriter] = []
"""The writers of this process not closed yet, oldest first."""


def closing_metrics_on_error(job: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of a job: a :class:`MetricsWriter` it opened and left open because it raised is closed (TensorBoard
    flushed, the W&B run finished as failed), so that the W&B run does not stay open in this process, where the next
    ``wandb.init`` would return it and log another job's records into it."""
    @functools.wraps(job)
    def run(*args: Any, **kwargs: Any) -> Any:
        opened_before = len(_open_writers)
        try:
            return job(*args, **kwargs)
        except BaseException:
            for writer in reversed(_open_writers[opened_before:]):
                try:
                    writer.close(failed=True)
                except Exception:  # noqa: BLE001 - the job's own error is the one to raise
                    logger.warning("closing %s after the job failed", writer.path, exc_info=True)
            raise
    return run
