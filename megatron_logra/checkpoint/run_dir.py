"""Claiming a run directory: a new run never silently replaces an earlier one.

A run directory holds one run: ``config.yaml``, ``metrics.jsonl``, ``summary.json``, the
tokenizer, tensorboard events, ``checkpoints/`` and what is derived from them (``summary.png`` of
``megatron-logra plot``, the RL job's ``deltas/`` and ``sglang_model/``, the traces of ``profile/``). Starting a *new* run (not
``--resume``) in a directory that already holds a run's checkpoints, metrics or summary is refused
with an error naming what is there, before anything is written: mixing two runs would overwrite the
old config and summary, truncate its metrics, let checkpoint pruning delete either run's checkpoints
and leave the old run's plot beside the new run's files. ``train.overwrite=true`` deletes the old
run's outputs first (rank 0), then every rank proceeds. While a job runs, its rank 0 holds a lock on the
run directory (:func:`lock_run_dir`), so that a second job there, resumed or new, is refused. What a resume
reads from the directory (:func:`resume_config`, :func:`check_resume_steps`) lives in
:mod:`megatron_logra.checkpoint.resuming`, and the writability and shared-storage checks
(:func:`check_shared_storage`) in :mod:`megatron_logra.checkpoint.run_dir_storage`; both are importable from here.
"""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch.distributed as dist

from megatron_logra.checkpoint.catalog import _complete_checkpoints
from megatron_logra.checkpoint.resuming import check_resume_steps, resume_config
from megatron_logra.checkpoint.run_dir_storage import check_shared_storage, run_dir_unwritable
from megatron_logra.dirlock import lock_directory, release_directory
from megatron_logra.metrics import SAMPLES_FILE
from megatron_logra.run_summary import BEFORE_FILE
from megatron_logra.wandb_log import WANDB_ID_FILE

logger = logging.getLogger(__name__)

__all__ = ["claim_run_dir", "has_checkpoint", "restart_command", "lock_run_dir", "release_run_dir",
           "releasing_run_dir", "check_resume_steps",
           "check_shared_storage", "resume_config", "RUN_OUTPUTS"]

RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "summary.png", "tensorboard", "config.yaml", "tokenizer",
               "deltas", "sglang_model", "profile", BEFORE_FILE, SAMPLES_FILE, WANDB_ID_FILE)
"""What a run writes into its run directory, or is derived from it there: a new run removes each of them that
is present (:func:`claim_run_dir`), so none of a previous run's can be taken for the new run's (the id of its
W&B run among them; W&B's own files, ``RUN/wandb``, stay: an offline run there may not be synced yet)."""

_CREATED: set[str] = set()
"""Run directories (absolute paths) :func:`claim_run_dir` created in this process (see :func:`release_run_dir`)."""

_RUN_RESULTS = ("summary.json", "summary.png")
"""Files that only a run that trained (or was plotted) leaves: present, they count as a previous run."""


def _previous_run(run_dir: Path) -> list[str]:
    found = []
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
        found.append(f"checkpoints/{steps[-1]}" if steps else "checkpoints/")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    found.extend(name for name in _RUN_RESULTS if (run_dir / name).exists())
    return found


def claim_run_dir(run_dir: Union[str, Path], *, resume: bool, overwrite: bool, lock: bool = True,
                  writes: bool = True) -> None:
    """Make ``run_dir`` ready for a run; every rank calls it (it synchronises when distributed).

    ``resume``: the directory is continued as it is. Otherwise a directory holding a previous run (a
    checkpoint, a non-empty ``metrics.jsonl``, ``summary.json`` or ``summary.png``) raises ``ValueError``
    naming it and the two ways on (``--resume RUN_DIR``, ``train.overwrite=true``), unless ``overwrite``.
    A run directory that another running job holds (its rank 0's lock on the directory,
    :func:`lock_run_dir`, taken here with ``lock`` and held until :func:`release_run_dir`, which the jobs call
    as they end, or the end of the process) is a ``ValueError`` too, resumed or not; ``lock=False`` (held-out
    evaluation, which only reads) neither takes nor checks it. A new run that goes ahead then has every :data:`RUN_OUTPUTS` entry present removed (rank 0): the previous
    run's with ``overwrite`` (a warning names it), else what a start that never finished a step left (its
    ``config.yaml``, empty TensorBoard events, tokenizer). Other files in the directory stay. A path that
    exists but is not a directory is a ``ValueError`` too, and so is one that cannot be created or written
    (checked by writing a file into it, before the model is built, resumed or not: a job would otherwise fail
    at its first save, or a resumed one writing ``config.yaml``). ``writes=False`` (held-out evaluation) writes
    nothing and checks neither that nor shared storage: a read-only run directory can be evaluated.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"train.run_dir={str(run_dir)!r} exists and is not a directory; choose another train.run_dir")
    if not run_dir.exists():
        _CREATED.add(str(run_dir.absolute()))
    if writes and not (dist.is_initialized() and dist.get_world_size() > 1):  # the collective check writes too
        problem = run_dir_unwritable(run_dir, resume=resume)
        if problem:
            raise ValueError(problem)
    if writes:
        check_shared_storage(run_dir, resume=resume)
    if lock:
        _lock_everywhere(run_dir)
    if resume:
        return
    found = _previous_run(run_dir)
    if found and not overwrite:
        if not has_checkpoint(run_dir):  # --resume would refuse it: restarting is the only way to continue
            raise ValueError(f"train.run_dir={str(run_dir)!r} already holds a run ({', '.join(found)}) that "
                             f"{restart_command(run_dir)}, or choose a new train.run_dir")
        raise ValueError(f"train.run_dir={str(run_dir)!r} already holds a run ({', '.join(found)}); continue it with "
                         f"--resume {run_dir}, choose a new train.run_dir, or replace it with train.overwrite=true")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    present = [name for name in RUN_OUTPUTS if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if present and rank0:
        if found:
            logger.warning("train.overwrite=true: removing the previous run in %s (%s)", run_dir, ", ".join(found))
        else:
            logger.info("removing what an earlier start that never finished a step left in %s (%s)", run_dir,
                        ", ".join(present))
        for name in present:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def has_checkpoint(run_dir: Union[str, Path]) -> bool:
    """Whether ``run_dir/checkpoints`` holds a published save (what ``--resume`` can continue from)."""
    return bool(_complete_checkpoints(Path(run_dir) / "checkpoints"))


def restart_command(run_dir: Union[str, Path]) -> str:
    """Why a run without a checkpoint cannot be continued and how to start it again, with the command that
    repeats its ``config.yaml`` when it has one (a phrase: "the run {restart_command(RUN)}")."""
    cfg_path = Path(run_dir) / "config.yaml"
    # a run started by a bare --resume recorded train.resume: true, which train.overwrite=true is refused with
    fresh = " train.resume=false" if cfg_path.is_file() and _records_resume(cfg_path) else ""
    command = f" (megatron-logra train {cfg_path}{fresh} train.overwrite=true repeats its config)" \
        if cfg_path.is_file() else ""
    return ("stopped before its first checkpoint (its train.save_interval), so there is nothing to continue with "
            f"--resume; start it again from step 0, replacing it, with train.overwrite=true{command}")


def _records_resume(cfg_path: Path) -> bool:
    """Whether the run's ``config.yaml`` holds ``train.resume: true`` (False when it cannot be read)."""
    import yaml

    try:
        data = yaml.safe_load(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    train = data.get("train") if isinstance(data, dict) else None
    return isinstance(train, dict) and train.get("resume") is True


def lock_run_dir(run_dir: Union[str, Path]) -> Optional[str]:
    """Take the run directory's lock for this process: None when taken (or already held by this process, or
    when ``run_dir`` does not exist or cannot be locked), else the ``ValueError`` message saying that another
    job holds it and what to do.

    Two jobs writing one run directory (a job resubmitted while the first still runs, the same
    ``train.run_dir`` given twice) would remove each other's unfinished saves, prune each other's checkpoints
    and interleave ``metrics.jsonl``. The lock is an exclusive, non-blocking ``flock`` on the directory itself
    (no file is written into it). A file system without ``flock`` support for directories (some network
    mounts) is skipped: no lock, no error."""
    try:
        taken = lock_directory(run_dir)
    except OSError:  # a missing or unreadable directory (reported by the other checks), or no flock there
        return None
    if taken:
        return None
    return (f"train.run_dir={str(run_dir)!r} is in use by another running job (it holds the directory's lock); "
            f"wait for that job to end (or stop it) before starting another there, or choose another "
            f"train.run_dir: two jobs in one run directory would delete each other's checkpoints")


def release_run_dir(run_dir: Union[str, Path], *, failed: bool = False) -> None:
    """Release this process's lock on ``run_dir`` (:func:`lock_run_dir`), if it holds one: a job calls it as it
    ends, so that another job of the same process (a script running several, a test) or a later process may
    take the directory. ``failed``: a directory :func:`claim_run_dir` created and this process locked is removed
    while still empty. Never raises."""
    created = str(Path(run_dir).absolute())
    remove = failed and created in _CREATED
    _CREATED.discard(created)
    release_directory(run_dir, remove_if_empty=remove)


def releasing_run_dir(job: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of a job ``job(cfg, ...)``: :func:`release_run_dir` of ``cfg.train.run_dir`` once it returns or
    raises; a job that raises also removes the run directory when :func:`claim_run_dir` created it, this process
    holds its lock and it is still empty (a start refused by a later check leaves no empty directory; anything
    written there stays, and so does a directory another job holds)."""
    @functools.wraps(job)
    def run(cfg, *args, **kwargs):
        finished = False
        try:
            result = job(cfg, *args, **kwargs)
            finished = True
            return result
        finally:
            release_run_dir(cfg.train.run_dir, failed=not finished)
    return run


def _lock_everywhere(run_dir: Path) -> None:
    """Rank 0 takes the run directory's lock (:func:`lock_run_dir`); its refusal is the same ``ValueError``
    on every rank (collective when distributed)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    problem = [lock_run_dir(run_dir) if not distributed or dist.get_rank() == 0 else None]
    if distributed:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ValueError(problem[0])
