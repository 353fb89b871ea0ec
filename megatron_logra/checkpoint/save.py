"""Write one checkpoint collectively: ``step_XXXXXXXX.tmp``, synced, checksummed, renamed, then ``latest``.

The on-disk format and its guarantees are described in :mod:`megatron_logra.checkpoint`. Every phase is
shared by all ranks (:mod:`.collective`), so a failure anywhere is the same :class:`CheckpointError`
everywhere and ``latest`` keeps naming the last complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from torch import nn

from megatron_logra.checkpoint.catalog import _prune, aside_name, settle_asides
from megatron_logra.checkpoint.collective import _on_every_rank, _shared_outcome
from megatron_logra.checkpoint.dist_writer import _save_dist
from megatron_logra.checkpoint.files import save_safetensors
from megatron_logra.checkpoint.integrity import (
    FORMAT_VERSION,
    CheckpointError,
    atomic_write_text,
    file_records,
    fsync_path,
    meta_crc32,
    sync_own_files,
    write_synced,
)
from megatron_logra.checkpoint.rng import rng_state
from megatron_logra.checkpoint.sharding import _DIST, _sharded_state
from megatron_logra.parallel import ParallelGroups, group_rank, group_size, world_group

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint"]


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def save_checkpoint(
    run_dir: Union[str, Path],
    step: int,
    model: Union[nn.Module, Sequence[nn.Module]],
    optimizer: Any,
    groups: ParallelGroups,
    *,
    extra: Optional[dict] = None,
    config: Optional[dict] = None,
    keep_last: int = 2,
    checksums: bool = True,
) -> Path:
    """Write checkpoint ``step`` collectively (every rank calls it). ``optimizer`` provides
    ``sharded_state()`` (:mod:`megatron_logra.optim.state`); ``None`` saves the weights only.
    ``checksums``: record the CRC-32 of every file in meta.json (hashed by all ranks, each a
    share), so that loading detects a file corrupted at the same size; sizes are always recorded.

    A failure on any rank in any phase raises the same :class:`CheckpointError` on every rank; ``latest``
    still names the last complete checkpoint and the unfinished ``step_XXXXXXXX.tmp`` is removed (by rank
    0, best effort: one left behind is never loaded and is removed by the next save)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = group_rank(world_group())
    try:
        return _save(root, final, tmp, rank, step, model, optimizer, groups, extra, config, keep_last, checksums)
    except CheckpointError:
        if rank == 0:  # every rank is past its writes (the error was shared): drop the unfinished save
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(root: Path, final: Path, tmp: Path, rank: int, step: int, model, optimizer, groups: ParallelGroups,
          extra: Optional[dict], config: Optional[dict], keep_last: int, checksums: bool) -> Path:

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for unfinished in root.glob("step_*.tmp"):  # killed saves: never a checkpoint
                shutil.rmtree(unfinished)
            settle_asides(root)  # replacements of a checkpoint that a kill interrupted
            (tmp / _DIST).mkdir(parents=True)

    _on_every_rank(step, root, "preparing its directory", prepare)
    sharded, scalars, _ = _sharded_state(model, optimizer)
    _save_dist(step, root, sharded, tmp / _DIST)
    _on_every_rank(step, root, "writing the RNG states",
                   lambda: save_safetensors(rng_state(), tmp / f"rng_rank{rank}.safetensors"))

    def list_and_sync() -> dict[str, int]:
        sizes = _file_sizes(tmp)
        sync_own_files(tmp, list(sizes), rank)
        return sizes

    sizes = _on_every_rank(step, root, "syncing its files to storage", list_and_sync)
    error: Optional[BaseException] = None
    try:
        files = file_records(tmp, sizes, checksums) if checksums or rank == 0 else {}
        if rank == 0:
            _finish_save(root, tmp, final, step, groups, scalars, extra, config, files, keep_last)
    except Exception as exc:  # noqa: BLE001 - shared below, so no rank waits for a rank 0 that gave up
        error = exc
    # also the closing barrier: the other ranks wait here for rank 0 to publish the checkpoint
    _shared_outcome(step, root, "finishing it", error)
    return final


def _finish_save(root: Path, tmp: Path, final: Path, step: int, groups: ParallelGroups, scalars: dict,
                 extra: Optional[dict], config: Optional[dict], files: dict, keep_last: int) -> None:
    """Rank 0: write meta.json last, rename the save into place, point ``latest`` at it, prune.

    A checkpoint of the same step already there is never deleted before the new one is in place: it is
    renamed aside (:func:`~megatron_logra.checkpoint.catalog.aside_name`), the save renamed in (on a failure
    there the old one is renamed back), ``latest`` written, and only then the aside copy deleted (best effort:
    the next save deletes what is left). A kill between the renames leaves the aside copy, which
    :func:`~megatron_logra.checkpoint.catalog.latest_checkpoint` reads and the next save restores."""
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "dp": groups.dp_size,
        "world_size": group_size(world_group()),
        "state": scalars,
        "extra": extra or {},
        "config": config or {},
        "files": files,
    }
    meta["meta_crc32"] = meta_crc32(meta)
    write_synced(tmp / "meta.json", json.dumps(meta, indent=1))
    fsync_path(tmp, directory=True)
    aside = None
    if final.exists() or final.is_symlink():
        aside = aside_name(final)
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside is not None:
            os.replace(aside, final)  # the previous checkpoint of this step back under its name
        raise
    fsync_path(root, directory=True)
    atomic_write_text(root / "latest", final.name)
    _prune(root, step, keep_last)
    if aside is not None:
        try:
            shutil.rmtree(aside)
        except OSError as exc:
            logger.warning("could not delete the replaced checkpoint %s (%s): it is never loaded, and the next "
                           "save deletes it", aside, exc)
    logger.info("saved checkpoint %s", final)
