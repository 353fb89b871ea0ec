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


_INPUT_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ValueError)
"""Errors of bad input (an engine argument, a path, a config value) that reach the other ranks as the same
builtin type, so that each reports them as bad input (the CLI: one error line, no traceback)."""


def share_from_driver(fn: Callable[[], Any], group: Any) -> Any:
    """Run ``fn`` on ``group``'s rank 0 and give its result, or its error, to every rank of ``group``.

    ``group``: a process group, ``dist.group.WORLD``, or None (this rank alone). Every rank must call.
    ``SyncError`` keeps its ``kind``; bad input (:data:`_INPUT_ERRORS`, e.g. a ``ValueError``) stays that
    builtin type and every other error becomes ``RuntimeError`` on non-driving ranks. The
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
            box[0] = ("sync", exc.kind, exc.message)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            kind = next((t.__name__ for t in _INPUT_ERRORS if isinstance(exc, t)), None)
            box[0] = ("error", type(exc).__name__, str(exc), kind)
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
    message = f"the rank driving the rollout engine failed: {status[1]}: {status[2]}"
    raise {t.__name__: t for t in _INPUT_ERRORS}.get(status[3], RuntimeError)(message)
