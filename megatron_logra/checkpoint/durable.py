"""Durable writes of checkpoint and run files: the fsync discipline.

A file is on storage only once it and the directory entry naming it have been synced; a rename is atomic
only once the directory is. This module owns that discipline: syncing a file or directory (tolerating file
systems that cannot sync directories), writing a synced file, replacing a file atomically, and syncing the
files of a checkpoint that this rank wrote. The integrity checks of what was written (CRC-32s, meta.json)
are :mod:`megatron_logra.checkpoint.integrity`.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Sequence, Union

__all__ = ["fsync_path", "write_synced", "atomic_write_text", "sync_own_files"]


_OWN_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
"""torch_dist shard files are named ``__{writing rank}_{n}.distcp``."""


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """Flush ``path`` (a file, or a directory's entries) to storage. File systems that cannot sync a
    directory (EINVAL / ENOTSUP on some network file systems) are skipped; any other error raises."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    except OSError as exc:
        if directory and exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EACCES):
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if not (directory and exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and flush it to storage before returning."""
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    """Replace ``path`` by a file holding ``text``, durably: write a synced temp file, rename, sync
    the directory. A crash or a full disk at any moment leaves the old file or the new one, never a
    partial one (``config.yaml``, ``summary.json``, ``checkpoints/latest``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, text)
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)


def sync_own_files(tmp: Path, names: Sequence[str], rank: int) -> None:
    """fsync every file ``names`` (relative to ``tmp``) that this rank wrote (on a network file system
    a sync flushes the caller's own dirty pages only): its RNG file and torch_dist shards; rank 0 also
    every file no other rank writes (torch_dist's metadata, megatron's common state) and the directories."""
    for rel in names:
        name = Path(rel).name
        shard = _OWN_SHARD.fullmatch(name)
        if name.startswith("rng_rank"):
            mine = name == f"rng_rank{rank}.safetensors"
        elif shard is not None:
            mine = int(shard.group(1)) == rank
        else:
            mine = rank == 0
        if mine:
            fsync_path(tmp / rel)
    if rank == 0:
        for d in sorted({tmp, *((tmp / rel).parent for rel in names)}):
            fsync_path(d, directory=True)
