"""One rank of a group drives a rollout engine; every rank of the group gets the result.

Generation runs once per model-parallel group (its rank 0), and the rollouts reach the group's
other ranks by broadcast, so tensor- and pipeline-parallel ranks train on the very same rollouts
whatever the kernels of their devices do. Used by the SGLang engine (one rank talks to SGLang) and
the embedded engine (every rank holds a copy, one generates).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from megatron_logra.parallel import cpu_group, group_rank, group_size
from megatron_logra.sync.errors import SyncError

__all__ = ["is_driver", "share_from_driver"]


def is_driver(group: Any) -> bool:
    """Whether this rank is rank 0 of ``group`` (None: this rank alone)."""
    return group_rank(group) == 0


def share_from_driver(fn: Callable[[], Any], group: Any) -> Any:
    """Run ``fn`` on ``group``'s rank 0 and give its result, or its error, to every rank of ``group``.

    ``group``: a process group, ``dist.group.WORLD``, or None (this rank alone). Every rank must call.
    ``SyncError`` keeps its ``kind``; other errors become ``RuntimeError`` on non-driving ranks. The
    result travels over ``group``'s gloo twin (:func:`~megatron_logra.parallel.cpu_group`), so the
    waiting ranks hold no GPU while the driver works.
    """
    if group_size(group) == 1:
        return fn()
    group = cpu_group(group)
    box: list[Any] = [None]
    if is_driver(group):
        try:
            box[0] = ("ok", fn())
        except SyncError as exc:
            box[0] = ("sync", exc.kind, str(exc).removeprefix(f"[{exc.kind}] "))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", type(exc).__name__, str(exc))
            original = exc
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast_object_list(box, src=src, group=group)
    status = box[0]
    if status[0] == "ok":
        return status[1]
    if status[0] == "sync":
        raise SyncError(status[1], status[2])
    if is_driver(group):
        raise original
    raise RuntimeError(f"the rank driving the rollout engine failed: {status[1]}: {status[2]}")
