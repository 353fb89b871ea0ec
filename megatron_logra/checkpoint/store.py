"""Save and resume everything stateful with megatron-core ``dist_checkpointing``.

A checkpoint ``RUN/checkpoints/step_XXXXXXXX/`` holds

* ``dist/`` — megatron-core's sharded checkpoint (torch_dist backend) of the model and every
  optimizer tensor (AdamW moments, fp32 masters, LoGRA row moments), each a slice of a global
  tensor, so it loads under any tensor / pipeline / data-parallel layout. Projections are
  regenerated from ``(seed, layer, update)``, never stored.
* ``rng_rank{r}.safetensors`` — each rank's RNG states (restored when the layout is the same).
* ``meta.json`` — written last: format version, step, layout, the layout-independent scalars
  (optimizer counters, KL-controller and RL-loop state), the config, and every other file under
  ``files`` as ``{relative path: {"bytes": size, "crc32": "8 hex digits"}}`` (``crc32`` absent
  when saved with ``checksums=False``; checkpoints of older versions hold plain sizes, which
  still load, with sizes checked only).

A save goes to ``step_XXXXXXXX.tmp`` and is renamed when complete; ``RUN/checkpoints/latest``
names the newest complete checkpoint and is replaced atomically after the rename, so a kill at
any moment (including mid-save) leaves the previous checkpoint usable. Every file is fsync'ed by
the rank that wrote it, and meta.json, ``latest`` and the directories by rank 0, before the save
is published, so a node crash or power loss cannot leave ``latest`` naming a checkpoint whose
files never reached storage (``latest`` missing altogether, e.g. a kill between the first rename and
its write: the newest complete checkpoint, with a warning; a ``latest`` naming anything else than a
complete ``step_XXXXXXXX`` beside it is refused, naming the newest earlier one to continue from:
:func:`latest_checkpoint`). meta.json carries a CRC-32 of its own content (``meta_crc32``). A
failure on any rank during a save reaches every rank as the same :class:`CheckpointError`.
Pruning keeps the ``keep_last`` newest checkpoints up to the step just saved; checkpoints of
later steps (left by a run whose ``latest`` was rolled back) are kept, and unfinished
``step_*.tmp`` saves of any step are removed. Loading checks, before
anything is modified: the format, every recorded file's presence and size (cheap), then every
recorded CRC-32 (reads each file once: a shard corrupted at the same size is named instead of
loading as wrong weights), then that ``dist/``'s pickles (DCP's ``.metadata`` index, the stored byte
objects) hold plain data only (:mod:`.dcp_metadata`: a crafted checkpoint is refused instead of
running code, whatever its CRC-32s), then the presence of every tensor.

The CRC-32s (``zlib.crc32``, 16 MiB chunks, so memory stays flat; :mod:`.integrity`) are computed
by all ranks together, at save and at load: the files are split into disjoint shares balanced by
size (``checksum_shares``), each rank hashes its share on a few threads (zlib releases the GIL)
and the results are gathered over the world group, so every rank raises the same error. CRC-32
detects accidental corruption (bit flips, torn or overwritten blocks), not tampering; it runs at
~3.4 GB/s per core where sha256 manages ~1.5 GB/s, i.e. ~0.3 s per GB per rank at save and load.

megatron-core's torch_dist writer collects results through a ``multiprocessing`` manager started
with ``spawn``: a script that calls the training functions directly must guard its entry point
with ``if __name__ == "__main__":`` (the ``megatron-logra`` CLI does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from megatron_logra.checkpoint.compat import architecture_error, architecture_problems, check_architecture, check_compatible
from megatron_logra.checkpoint.integrity import (
    FORMAT_VERSION,
    CheckpointError,
    atomic_write_text,
    file_records,
    fsync_path,
    meta_crc32,
    read_meta,
    read_meta_json,
    removed_while_read,
    sync_own_files,
    write_synced,
)
from megatron_logra.checkpoint.rng import restore_rng, rng_state
from megatron_logra.checkpoint.sharding import (
    model_sharded_state,
    optimizer_sharded_state,
    param_shardings,
    slot_name,
)
from megatron_logra.parallel import ParallelGroups, all_gather_bytes, world_group

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "check_architecture",
           "read_meta", "CheckpointError", "FORMAT_VERSION"]  # check_architecture: from .compat; the last three: from .integrity

_DIST = "dist"


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


_STEP_DIR = re.compile(r"step_(\d{8,})")


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
        return reports or [(_global_rank(), "")]
    return [(_global_rank(), f"{type(error).__name__}: {error}")]


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


def _save_dist(step: int, root: Path, sharded: dict, out: Path) -> None:
    """megatron-core's ``dist_checkpointing.save`` (torch_dist backend) in phases, each ending in a
    :func:`_shared_outcome`, so that a failure on any rank (rank 0's ``common.pt`` or ``metadata.json``
    write, which only rank 0 does, outside any collective) is the same :class:`CheckpointError` on
    every rank instead of leaving the others in the next collective. The files written are the same."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_common_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded_strategy = get_default_save_sharded_strategy()
    common_strategy = get_default_save_common_strategy()
    if not sharded_strategy.can_handle_sharded_objects:  # torch_dist stores ShardedObjects itself
        raise CheckpointError(f"the {sharded_strategy.backend} checkpoint backend does not store sharded objects")
    # collective (megatron-core's access-integrity check gathers every rank's shards; rank 0 judges them)
    sharded_part, common = _on_every_rank(step, root, "checking the sharded state", lambda: save_preprocess(sharded))
    _on_every_rank(step, root, "writing the common state (common.pt)",
                   lambda: common_strategy.save_common(common, str(out)))  # rank 0 writes it
    def write_shards() -> None:
        _in_process_write_results()
        with _metadata_write_failures() as failures:
            sharded_strategy.save(sharded_part, str(out))
        if failures:  # rank 0's dist/.metadata: raised here, after the ranks left megatron-core's collectives
            raise failures[0]

    _on_every_rank(step, root, "writing the sharded tensors", write_shards)

    def write_config() -> None:
        if _global_rank() == 0:
            save_config(CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version), str(out))

    _on_every_rank(step, root, "writing the checkpoint's metadata.json", write_config)


def _in_process_write_results() -> None:
    """Give megatron-core's torch_dist writer an in-process queue for its write results.

    The writer's workers (forked by the saving process) report to that process, which puts the collected
    results on ``filesystem_async._results_queue`` and reads them back itself. megatron-core fills that
    module attribute at the first save with the queue of a ``multiprocessing`` Manager: a spawned helper
    process, kept for the life of the job, which its asynchronous saves need and this project's synchronous
    saves do not. It costs a fresh interpreter that imports torch to unpickle the results (2-3 s at the
    first save of every rank), and it is one more process that a stop signal sent to a whole job step
    (Slurm) reaches: killed, it takes the save the stop asked for down with a broken pipe. A
    ``queue.Queue`` does the same job inside the saving process. Set once; a queue already set (another
    caller's) is left as it is.

    This patches megatron-core (the module attribute
    ``megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue``) on every device, GPUs
    included; it is valid because every save here is synchronous (``dist_checkpointing.save`` without
    ``async_sharded_save``). The CPU-only patches are in ``megatron_logra/cpu_shim.py``, whose docstring
    lists the others."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if hasattr(filesystem_async, "_get_write_results_queue") and getattr(filesystem_async, "_results_queue",
                                                                          True) is None:
        filesystem_async._results_queue = queue.Queue()


@contextlib.contextmanager
def _metadata_write_failures():
    """Collect (instead of raise) the errors of DCP's ``dist/.metadata`` write during one sharded save.

    megatron-core's coordinator (rank 0) writes ``.metadata`` (``FileSystemWriterAsync.finish``) and
    only then broadcasts whether the save failed; an exception from that write (a full disk) skips the
    broadcast, leaving the other ranks in it while rank 0 moves on to the next collective. The writer
    the torch_dist strategy builds is swapped, for this save only, for a subclass whose ``finish``
    records its error, so the broadcast happens and the caller raises the error afterwards.

    This patches megatron-core (the module attribute
    ``megatron.core.dist_checkpointing.strategies.torch.FileSystemWriterAsync``, restored on exit) on every
    device, GPUs included: megatron-core offers no hook for the failure. The CPU-only patches are in
    ``megatron_logra/cpu_shim.py``, whose docstring lists the others."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy

    base = mcore_torch_strategy.FileSystemWriterAsync
    failures: list[BaseException] = []

    class _Writer(base):  # type: ignore[misc,valid-type]
        def finish(self, *args, **kwargs):
            try:
                return super().finish(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised by the caller after the broadcast
                failures.append(exc)

    mcore_torch_strategy.FileSystemWriterAsync = _Writer
    try:
        yield failures
    finally:
        mcore_torch_strategy.FileSystemWriterAsync = base


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _sharded_state(model, optimizer) -> tuple[dict, dict, list]:
    """(sharded state dict for dist_checkpointing, optimizer scalars, ``[(slot name, slot)]``)."""
    model_sd = model_sharded_state(model)
    if optimizer is None:  # weights only (e.g. an export)
        return dict(model_sd), {}, []
    scalars, slots = optimizer.sharded_state()
    shardings = param_shardings(model_sd)
    sharded = dict(model_sd)
    sharded["optimizer"] = optimizer_sharded_state(slots, shardings)
    return sharded, scalars, [(slot_name(slot, shardings), slot) for slot in slots]


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
    rank = _global_rank()
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
            (tmp / _DIST).mkdir(parents=True)

    _on_every_rank(step, root, "preparing its directory", prepare)
    sharded, scalars, _ = _sharded_state(model, optimizer)
    _save_dist(step, root, sharded, tmp / _DIST)
    _on_every_rank(step, root, "writing the RNG states",
                   lambda: save_file(rng_state(), str(tmp / f"rng_rank{rank}.safetensors")))

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
    """Rank 0: write meta.json last, rename the save into place, point ``latest`` at it, prune."""
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "dp": groups.dp_size,
        "world_size": _world_size(),
        "state": scalars,
        "extra": extra or {},
        "config": config or {},
        "files": files,
    }
    meta["meta_crc32"] = meta_crc32(meta)
    write_synced(tmp / "meta.json", json.dumps(meta, indent=1))
    fsync_path(tmp, directory=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root, directory=True)
    atomic_write_text(root / "latest", final.name)
    _prune(root, step, keep_last)
    logger.info("saved checkpoint %s", final)


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest checkpoints up to ``step`` (the one just saved, which
    ``latest`` names). Checkpoints of later steps are someone's earlier timeline (``latest`` was
    rolled back): kept, and replaced when training reaches their step."""
    saved = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))
    for _, old in [(s, p) for s, p in saved if s <= step][:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    later = [p.name for s, p in saved if s > step]
    if later:
        logger.warning("%s holds checkpoints of later steps than %d (%s): kept, not pruned; they are replaced "
                       "when training reaches their step", root, step, ", ".join(later[:4]))


def _complete_checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories ``step_XXXXXXXX`` of ``root`` whose meta.json reads and checks by itself
    (:func:`~megatron_logra.checkpoint.integrity.read_meta_json`), oldest first. A save is renamed to its
    final name only once complete, so these are the published ones (their shards are checked at load)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m is None or not (p / "meta.json").is_file():
            continue
        try:
            read_meta_json(p)
        except (CheckpointError, OSError):
            continue
        found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def earlier_checkpoint_hint(root: Path, broken: Optional[Path] = None) -> str:
    """What to do about a broken checkpoint in ``root`` (a run's ``checkpoints/``): the text after ``; ``
    naming the newest other checkpoint there (older than ``broken``, when given) and how to resume from it
    (write its name into ``root/latest``), or, when none is left, how to start over."""
    before = _STEP_DIR.fullmatch(broken.name) if broken is not None else None
    others = [p for p in _complete_checkpoints(root)
              if before is None or int(_STEP_DIR.fullmatch(p.name).group(1)) < int(before.group(1))]
    if others:
        return (f"the newest {'earlier ' if before is not None else ''}checkpoint there is {others[-1].name}: to "
                f"continue from it, write its name into {root / 'latest'} (echo {others[-1].name} > {root / 'latest'})")
    return (f"no earlier checkpoint is left in {root}: restore its files, or start the run over "
            f"(train.overwrite=true, or another train.run_dir)")


_warned_missing_latest: set[str] = set()


def latest_checkpoint(run_dir: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None if it has none. Reads ``checkpoints/latest`` (and
    checks only that the checkpoint it names has a meta.json: loading checks the rest).

    * ``latest`` absent: None when ``checkpoints/`` holds no complete checkpoint; otherwise (a job killed
      between publishing its first checkpoint and writing ``latest``, or ``latest`` deleted) the newest
      complete one, with a warning (once per process), so that a resumed run never starts over on top of
      it (and then replaces it when it reaches its step).
    * ``latest`` that is empty, unreadable, or holds anything but the name of a checkpoint directory beside
      it (``step_XXXXXXXX``: a path elsewhere would resume another run's checkpoint), or names one that is
      missing or has no meta.json: :class:`CheckpointError` naming ``latest``, what it holds, and the
      newest earlier checkpoint to continue from (:func:`earlier_checkpoint_hint`)."""
    root = Path(run_dir) / "checkpoints"
    marker = root / "latest"
    if not marker.exists() and not marker.is_symlink():
        complete = _complete_checkpoints(root)
        if not complete:
            return None
        if str(complete[-1]) not in _warned_missing_latest:
            _warned_missing_latest.add(str(complete[-1]))
            if _global_rank() == 0:
                logger.warning("%s is missing, but %s holds complete checkpoints (%s): using the newest, %s (a job "
                               "killed right after publishing a checkpoint leaves this; write that name into %s if "
                               "you meant to continue from another)", marker, root,
                               ", ".join(p.name for p in complete[-4:]), complete[-1].name, marker)
        return complete[-1]
    try:
        name = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{marker} is unreadable ({type(exc).__name__}: {exc}); "
                              f"{earlier_checkpoint_hint(root)}") from exc
    if not _STEP_DIR.fullmatch(name):
        held = "nothing (it is empty)" if not name else repr(name[:80])
        raise CheckpointError(f"{marker} holds {held}, not the name of a checkpoint directory beside it "
                              f"(step_XXXXXXXX); {earlier_checkpoint_hint(root)}")
    path = root / name
    if not (path / "meta.json").exists():
        what = "has no meta.json (incomplete or damaged)" if path.is_dir() else "does not exist (deleted?)"
        raise CheckpointError(f"{marker} names {name}, which {what}; {earlier_checkpoint_hint(root, path)}")
    return path


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line: torch's CheckpointException carries each rank's traceback
    in its message; its last line is the error."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return lines[-1]


def _load_chunk(chunk: nn.Module, state: dict, where: str) -> None:
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{where}: the checkpoint lacks parameters {missing[:4]}")


def load_checkpoint(
    path: Union[str, Path],
    model: Union[nn.Module, Sequence[nn.Module]],
    optimizer: Any,
    groups: ParallelGroups,
    *,
    checksums: bool = True,
    model_config: Any = None,
) -> dict:
    """Restore model, optimizer (``load_sharded_state``) and, for an unchanged layout, RNG
    states from ``path`` — saved under any TP/PP/DP layout. Returns the meta dict. Collective:
    every rank calls it.

    Everything is read and checked before the model or optimizer is modified: :func:`read_meta`
    over the world group (sizes; with ``checksums``, the recorded CRC-32s, each rank checking a
    share of the files — every rank raises the same CheckpointError naming a corrupt file), then,
    given the run's ``model_config`` (``ModelConfig``), its architecture against the checkpoint's
    (:func:`check_architecture`: a CheckpointError naming the field, not a tensor shape mismatch).
    Given an ``optimizer``, a weights-only checkpoint is a CheckpointError saying so."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    try:
        meta = read_meta(path, checksums=checksums, group=world_group())
    except CheckpointError as exc:  # a damaged checkpoint of a run: say which earlier one to continue from
        if _STEP_DIR.fullmatch(path.name) is None:
            raise
        raise CheckpointError(f"{exc}; {earlier_checkpoint_hint(path.parent, path)}") from exc
    if model_config is not None:
        problems = architecture_problems(meta, model_config)
        if problems:
            raise architecture_error(path, problems)
    sharded, current, named_slots = _sharded_state(model, optimizer)
    saved_state = meta.get("state")
    if (named_slots or current) and isinstance(saved_state, dict) and not saved_state:  # before comparing settings
        raise CheckpointError(f"{path} holds weights only (no optimizer state) and cannot be resumed")
    check_compatible(saved_state, current, str(path), config=meta.get("config") if isinstance(meta.get("config"), dict) else None)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        loaded = dist_checkpointing.load(sharded, str(path / _DIST))
    except (Exception, CheckpointException) as exc:  # torch.distributed.checkpoint / megatron raise many types
        if not path.is_dir():
            raise CheckpointError(removed_while_read(path)) from exc
        raise CheckpointError(f"{path}/{_DIST} could not be loaded into this model: {_one_line(exc)}") from exc
    if named_slots and "optimizer" not in loaded:
        raise CheckpointError(f"{path} holds weights only (no optimizer state) and cannot be resumed")
    same_layout = (meta["tp"], meta["pp"], meta["dp"]) == (groups.tp_size, groups.pp_size, groups.dp_size)
    rng_path = path / f"rng_rank{_global_rank()}.safetensors"
    rng = None
    if same_layout and rng_path.exists():
        try:
            rng = load_file(str(rng_path))
        except Exception as exc:  # safetensors raises its own error types for truncation
            raise CheckpointError(f"{rng_path} is unreadable (truncated or corrupt?): {exc}") from exc

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    with torch.no_grad():
        if len(chunks) == 1:
            _load_chunk(chunks[0], loaded["model"], str(path))
        else:
            for i, c in enumerate(chunks):
                _load_chunk(c, loaded[f"model{i}"], f"{path} (chunk {i})")
        for name, slot in named_slots:
            value = loaded["optimizer"][name]
            if value.data_ptr() != slot.tensor.data_ptr():
                slot.tensor.copy_(value.view_as(slot.tensor))
    try:
        if optimizer is not None:
            optimizer.load_sharded_state(meta["state"], [slot for _, slot in named_slots])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: optimizer state does not fit this run: {exc}") from exc
    if rng is not None:
        restore_rng(rng, str(path))
    elif not same_layout and groups.is_rank0:
        logger.warning("%s was saved at tp=%d pp=%d dp=%d; this run has tp=%d pp=%d dp=%d: weights and optimizer "
                       "state are resharded, RNG states start fresh", path, meta["tp"], meta["pp"], meta["dp"],
                       groups.tp_size, groups.pp_size, groups.dp_size)
    if groups.is_rank0:
        logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta
