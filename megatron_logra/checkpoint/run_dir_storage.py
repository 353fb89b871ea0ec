"""Whether a run directory can be written, by this process and by every rank (the checks of
:func:`~megatron_logra.checkpoint.run_dir.claim_run_dir`).

:func:`run_dir_unwritable` creates the directory and writes a probe file into it, returning None or the
``ValueError`` message naming ``train.run_dir`` and the fix (a resumed run's differs). :func:`check_shared_storage`
is collective: every rank must see the file rank 0 writes there and be able to write one of its own, else the
same ``ValueError`` is raised on every rank, naming the ranks and hosts. Nothing here is left in the directory.
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

__all__ = ["check_shared_storage", "run_dir_unwritable"]


_NEW_RUN_FIX = "choose a directory this job can create and write"
_RESUME_FIX = ("a resumed run writes its config.yaml, metrics and checkpoints there: make it writable, or copy the "
               "run elsewhere and resume the copy")


def _unwritable(run_dir: Path) -> Optional[str]:
    """Create ``run_dir`` and write a file into it; None, or why that failed (naming the field and the fix)."""
    probe = run_dir / f".write-check-{secrets.token_hex(4)}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return (f"train.run_dir={str(run_dir)!r} cannot be written: {exc.strerror or exc!r} "
                f"({exc.filename or run_dir}); {_NEW_RUN_FIX}")
    return None


def _fix_for(problem: Optional[str], resume: bool) -> Optional[str]:
    """:func:`_unwritable`'s message, with a resumed run's fix."""
    return problem.replace(_NEW_RUN_FIX, _RESUME_FIX) if problem and resume else problem


def run_dir_unwritable(run_dir: Path, *, resume: bool = False) -> Optional[str]:
    """Create ``run_dir`` and write a file into it (this process only): None, or the ``ValueError`` message
    saying why that failed, with the fix for a new run or, with ``resume``, a resumed one."""
    return _fix_for(_unwritable(run_dir), resume)


def check_shared_storage(run_dir: Path, *, wait_s: float = 5.0, resume: bool = False) -> None:
    """Every rank must see what rank 0 writes in ``run_dir`` (collective; no-op in one process).

    Checkpoints are written by every rank into one directory and finished by rank 0, so a run
    directory on node-local disks (the same path on each node, different contents) would leave
    each node with a partial checkpoint that no node can resume from. Rank 0 writes a file with a
    fresh token; every rank looks for it (for up to ``wait_s``, for slow network file systems), and every
    rank then writes a file of its own there (a read-only mount on one node would otherwise fail only at
    the first checkpoint). ``ValueError`` on every rank, naming the ranks and hosts that cannot see it or
    cannot write.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    token = [secrets.token_hex(8) if rank == 0 else None, None]  # [the probe's contents, rank 0's failure]
    if rank == 0:
        token[1] = run_dir_unwritable(run_dir, resume=resume)
        if token[1] is None:
            (run_dir / f".shared-storage-check-{token[0]}").write_text(token[0])
    dist.broadcast_object_list(token, src=0)  # rank 0's failure to write reaches every rank: none waits for it
    if token[1]:
        raise ValueError(token[1])
    probe = run_dir / f".shared-storage-check-{token[0]}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            seen = probe.read_text() == token[0]
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # every rank writes checkpoint shards
    problem = run_dir_unwritable(run_dir, resume=resume) if rank != 0 and seen else None
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname(), problem))
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (ok, host, _) in enumerate(views) if not ok]
    if blind:
        shown = ", ".join(f"rank {r} on {host}" for r, host in blind[:8])
        raise ValueError(f"train.run_dir={str(run_dir)!r} is not shared storage: {shown} cannot see a file rank 0 "
                         f"wrote there; checkpoints need a directory every node reads and writes (a shared file "
                         f"system), so give train.run_dir such a path")
    unwritable = [(r, host, p) for r, (_, host, p) in enumerate(views) if p]
    if unwritable:
        shown = ", ".join(f"rank {r} on {host}" for r, host, _ in unwritable[:8])
        raise ValueError(f"{unwritable[0][2]} (seen by {shown}; every rank writes its checkpoint shards there)")


