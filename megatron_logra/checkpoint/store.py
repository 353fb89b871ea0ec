"""Save and resume everything stateful with megatron-core ``dist_checkpointing``.

A checkpoint ``RUN/checkpoints/step_XXXXXXXX/`` holds

* ``dist/`` — megatron-core's sharded checkpoint (torch_dist backend) of the model and every
  optimizer tensor (AdamW moments, fp32 masters, LoGRA row moments), each a slice of a global
  tensor, so it loads under any tensor / pipeline / data-parallel layout. Projections are
  regenerated from ``(seed, layer, update)``, never stored.
* ``rng_rank{r}.safetensors`` — each rank's RNG states (restored when the layout is the same).
* ``meta.json`` — written last: format version, step, layout, the layout-independent scalars
  (optimizer counters, KL-controller and RL-loop state), the config, and the size of every file.

A save goes to ``step_XXXXXXXX.tmp`` and is renamed when complete; ``RUN/checkpoints/latest``
names the newest complete checkpoint and is replaced atomically after the rename, so a kill at
any moment (including mid-save) leaves the previous checkpoint usable. Loading checks the
format, the recorded file sizes and the presence of every tensor before anything is modified.

megatron-core's torch_dist writer collects results through a ``multiprocessing`` manager started
with ``spawn``: a script that calls the training functions directly must guard its entry point
with ``if __name__ == "__main__":`` (the ``megatron-logra`` CLI does).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from megatron_logra.checkpoint.sharding import (
    model_sharded_state,
    optimizer_sharded_state,
    param_shardings,
    slot_name,
)
from megatron_logra.parallel import ParallelGroups

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_meta", "CheckpointError", "FORMAT_VERSION"]

FORMAT_VERSION = 2
_DIST = "dist"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or incompatible with this run (bad input: the
    command line reports it as an error, without a traceback)."""


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tracker_states() -> dict[str, torch.Tensor]:
    """megatron-core's tensor-parallel RNG tracker states (dropout inside TP regions)."""
    try:
        from megatron.core import tensor_parallel

        return {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except (ImportError, AttributeError):
        return {}


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    for name, state in _tracker_states().items():
        rng[f"tracker.{name}"] = state
    return rng


def _restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in rng.items() if k.startswith("tracker.")}
    if tracker:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


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
) -> Path:
    """Write checkpoint ``step`` collectively (every rank calls it). ``optimizer`` provides
    ``sharded_state()`` (:mod:`megatron_logra.optim.state`); ``None`` saves the weights only."""
    from megatron.core import dist_checkpointing

    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _global_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / _DIST).mkdir(parents=True)
    _barrier()
    sharded, scalars, _ = _sharded_state(model, optimizer)
    dist_checkpointing.save(sharded, str(tmp / _DIST))
    save_file(_rng_state(), str(tmp / f"rng_rank{rank}.safetensors"))
    _barrier()
    if rank == 0:
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
            "files": _file_sizes(tmp),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(root / "latest", final.name)
        complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def latest_checkpoint(run_dir: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None if it has none."""
    root = Path(run_dir) / "checkpoints"
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{marker} names {path.name}, which has no meta.json (incomplete or deleted)")
    return path


def read_meta(path: Union[str, Path]) -> dict:
    """``meta.json`` of checkpoint ``path``, checked: format version and every recorded file
    present with its recorded size (a truncated or missing shard is named)."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path} is not a megatron_logra checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path} has format version {got}, expected {FORMAT_VERSION}")
    problems = []
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.exists():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel} has {f.stat().st_size} bytes, {size} were written (truncated or corrupt)")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else ""))
    return meta


_IDENTITY = ("kind", "rank", "seed", "distribution")


def _check_compatible(saved: Any, current: Any, where: str, path: str = "") -> None:
    """The saved optimizer scalars describe the same kind of state as this run's (same optimizer
    kind, LoGRA rank, seed and distribution) — checked before anything is read into the model."""
    if not isinstance(current, dict):
        return
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: meta.json lacks the state {path or 'scalars'} this run needs")
    for key, here in current.items():
        name = f"{path}.{key}" if path else key
        if key in _IDENTITY and here is not None and saved.get(key) != here:
            raise CheckpointError(f"{where}: saved with {name}={saved.get(key)!r}, this run has {here!r} "
                                  "(different optimizer settings; start a new run directory)")
        if isinstance(here, dict):
            if key not in saved:
                raise CheckpointError(f"{where}: meta.json lacks state '{name}'")
            _check_compatible(saved[key], here, where, name)


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
) -> dict:
    """Restore model, optimizer (``load_sharded_state``) and, for an unchanged layout, RNG
    states from ``path`` — saved under any TP/PP/DP layout. Returns the meta dict.

    Everything is read and checked before the model or optimizer is modified."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = read_meta(path)
    sharded, current, named_slots = _sharded_state(model, optimizer)
    _check_compatible(meta.get("state"), current, str(path))
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        loaded = dist_checkpointing.load(sharded, str(path / _DIST))
    except (Exception, CheckpointException) as exc:  # torch.distributed.checkpoint / megatron raise many types
        raise CheckpointError(f"{path}/{_DIST} could not be loaded into this model: {type(exc).__name__}: {exc}") from exc
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
        _restore_rng(rng)
    elif not same_layout:
        logger.warning("%s was saved at tp=%d pp=%d dp=%d; this run has tp=%d pp=%d dp=%d: weights and optimizer "
                       "state are resharded, RNG states start fresh", path, meta["tp"], meta["pp"], meta["dp"],
                       groups.tp_size, groups.pp_size, groups.dp_size)
    logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta
