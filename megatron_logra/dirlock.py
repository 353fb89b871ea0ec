"""Exclusive locks on directories, held by this process: one job per run directory, one trainer per delta
directory.

A lock is a non-blocking ``flock`` on the directory itself (nothing is written into it), kept until
:func:`release_directory` or the end of the process: the kernel releases it however the process ends (a
SIGKILL included), so a restarted job takes it again. A forked child (a checkpoint writer process, a
DataLoader worker) closes its inherited copy of the descriptor at once: a flock belongs to the open file
description, so a child that outlived a killed job, or was still being torn down, would otherwise keep the
lock and refuse the restarted job. Standard library only (the delta directory's lock is taken by code that
also runs inside inference servers).
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Union

__all__ = ["lock_directory", "release_directory", "LockUnsupported"]

_HELD: dict[tuple[int, int], tuple[str, int]] = {}
"""Directories this process holds the lock of: ``(st_dev, st_ino)`` -> (absolute path, file descriptor)."""


def _forget_in_child() -> None:
    """After ``fork``, in the child: close the inherited lock descriptors (the parent keeps the locks)."""
    for _, fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class LockUnsupported(OSError):
    """The directory's file system cannot ``flock`` it (some network file systems)."""


def lock_directory(path: Union[str, os.PathLike]) -> bool:
    """Take the lock of directory ``path`` for this process: True when taken (or already held by this process),
    False when another process holds it. ``OSError`` when the directory cannot be opened;
    :class:`LockUnsupported` when its file system cannot lock it."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    if key in _HELD:
        return True
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise LockUnsupported(exc.errno, exc.strerror) from exc
    _HELD[key] = (os.path.abspath(path), fd)  # closing the only descriptor would release the lock
    return True


def release_directory(path: Union[str, os.PathLike], *, remove_if_empty: bool = False) -> None:
    """Release this process's lock on ``path`` (by the path it was taken with), if it holds one; never raises.
    ``remove_if_empty``: remove the directory first when it is empty and this process holds its lock (a process
    refused the lock never removes a directory that another one is using)."""
    wanted = os.path.abspath(path)
    for key, (held, fd) in list(_HELD.items()):
        if held == wanted:
            if remove_if_empty:
                try:
                    os.rmdir(held)  # only ever an empty directory
                except OSError:
                    pass
            del _HELD[key]
            try:
                os.close(fd)
            except OSError:
                pass
