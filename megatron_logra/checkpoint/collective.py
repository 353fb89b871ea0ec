"""One outcome of a save on every rank: a failure on any rank is the same :class:`CheckpointError` on all.

Each phase of a save (:mod:`.save`, :mod:`.dist_writer`) runs through :func:`_on_every_rank`, which gathers
every rank's failure (if any) over the world group and raises one error naming the failed ranks, the phase
and the free space of the checkpoint directory's file system, so that no rank waits in a collective for a
rank that gave up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional


from megatron_logra.checkpoint.integrity import CheckpointError
from megatron_logra.parallel import all_gather_bytes, group_rank, world_group


def _shared_outcome(step: int, root: Path, what: str, error: Optional[BaseException]) -> None:
    """Collective over the world group: raise the same :class:`CheckpointError` on every rank if
    ``error`` is set on any (else return), so that no rank waits for one that gave up."""
    reported: dict[int, str] = {}
    free_bytes: list[int] = []
    local = {"reports": _failure_reports(error), "free": _free_bytes(root) if error is not None else None}
    for payload in all_gather_bytes(json.dumps(local).encode(), world_group()):
        gathered = json.loads(payload)
        for r, message in gathered["reports"]:
            if message or r not in reported:  # a rank's own account over another's "failed elsewhere"
                reported[r] = message
        if gathered["free"] is not None:
            free_bytes.append(gathered["free"])
    failed = [(r, m or "failed") for r, m in sorted(reported.items())]
    if failed:
        shown = "; ".join(f"rank {r} ({m})" for r, m in failed[:4]) + (" ..." if len(failed) > 4 else "")
        raise CheckpointError(f"saving checkpoint step {step} failed on {shown} while {what}; "
                              f"{root / 'latest'} still names the last complete checkpoint; "
                              f"{_room_hint(root, min(free_bytes) if free_bytes else None)}") from error


def _free_bytes(root: Path) -> Optional[int]:
    """Free bytes on ``root``'s file system, or ``None`` if it cannot be read."""
    try:
        return shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        return None


def _room_hint(root: Path, free_bytes: Optional[int]) -> str:
    """What to do after a failed save: the free space of ``root``'s file system (a full disk is the usual
    cause, and torch's writer does not always say so; the least any rank saw, so that every rank raises
    the same message) and how to continue."""
    free = "free space unknown" if free_bytes is None else f"{free_bytes / 2**20:.1f} MiB free"
    return (f"its file system has {free}: if it is full, make room (a save needs room for one checkpoint more "
            f"than train.keep_last keeps, as it prunes only once complete: remove step_* checkpoints older than "
            f"the one latest names, or lower train.keep_last) and continue with --resume {root.parent}")


def _failure_reports(error: Optional[BaseException]) -> list[tuple[int, str]]:
    """``[(global rank, "Type: message")]`` of the failures ``error`` stands for: torch.distributed.checkpoint's
    ``CheckpointException`` carries every failed rank's exception (the coordinator's; the other ranks get
    none: ``(this rank, "")``, "failed elsewhere"); any other error is this rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    if error is None:
        return []
    if isinstance(error, CheckpointException):
        reports = []
        for r, failure in error.failures.items():
            exc = failure[0] if isinstance(failure, tuple) else failure
            reports.append((int(r), _one_line(exc) if isinstance(exc, BaseException) else str(exc)))
        return reports or [(group_rank(world_group()), "")]
    return [(group_rank(world_group()), f"{type(error).__name__}: {error}")]


def _on_every_rank(step: int, root: Path, what: str, fn) -> Any:
    """``fn()`` on this rank, then :func:`_shared_outcome`. ``fn`` may run collectives only if every
    rank reaches each of them or fails consistently before it (as torch.distributed.checkpoint does:
    its ``CheckpointException``, a ``BaseException``, is raised on every rank and caught here too)."""
    from torch.distributed.checkpoint.api import CheckpointException

    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - shared with every rank, then raised
        error = exc
    _shared_outcome(step, root, what, error)
    return result


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line: torch's CheckpointException carries each rank's traceback
    in its message; its last line is the error."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return lines[-1]
