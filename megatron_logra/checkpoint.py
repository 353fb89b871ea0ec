"""Save and resume everything stateful: model, optimizer (LoGRA row moments and masters,
native AdamW), loop counters and RNG states. Projections are regenerated, never stored.

Format (no pickle): ``RUN/checkpoints/step_XXXXXXXX/`` holds per model-parallel rank a
``model_tp{t}_pp{p}.safetensors``, an ``optim_tp{t}_pp{p}.safetensors`` whose nested
structure lives in ``optim_tp{t}_pp{p}.json``, per rank ``rng_rank{r}.safetensors``, and a
``meta.json`` written last. A save is written to ``step_XXXXXXXX.tmp`` and renamed when
complete; ``RUN/checkpoints/latest`` names the newest complete one and is replaced
atomically after the rename, so a kill at any moment leaves the previous checkpoint usable.
Data-parallel replicas hold identical state, so only DP rank 0 writes model and optimizer.
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

from megatron_logra.parallel import ParallelGroups

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "flatten_state", "unflatten_state",
           "CheckpointError"]

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or from another layout."""


def flatten_state(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested dict/list state into a JSON skeleton and a flat name -> tensor dict."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[path] = obj.detach().cpu().contiguous()
            return {"__tensor__": path}
        if isinstance(obj, dict):
            return {"__dict__": [[_key(k), walk(v, f"{path}.{k}")] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"__list__": [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {path}")

    return walk(state, prefix or "state"), tensors


def _key(k: Any) -> Any:
    if isinstance(k, (str, int)):
        return k
    raise TypeError(f"state dict keys must be str or int, got {type(k).__name__}")


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            name = skeleton["__tensor__"]
            if name not in tensors:
                raise CheckpointError(f"tensor {name} is missing from the checkpoint")
            return tensors[name]
        if "__dict__" in skeleton:
            return {k: unflatten_state(v, tensors) for k, v in skeleton["__dict__"]}
        if "__list__" in skeleton:
            return [unflatten_state(v, tensors) for v in skeleton["__list__"]]
    return skeleton


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _model_state(model: Union[nn.Module, Sequence[nn.Module]]) -> dict[str, torch.Tensor]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            out[f"{i}.{name}"] = p.detach().cpu().contiguous()
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for truncation
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {exc}") from exc


def _tracker_states() -> dict[str, torch.Tensor]:
    """megatron-core's tensor-parallel RNG tracker states (empty without megatron)."""
    try:
        from megatron.core import tensor_parallel

        return {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except (ImportError, AttributeError):
        return {}


def _set_tracker_states(states: dict[str, torch.Tensor]) -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(states)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    """Write checkpoint ``step`` collectively (every rank must call it)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _global_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    tag = f"tp{groups.tp_rank}_pp{groups.pp_rank}"
    if groups.dp_rank == 0:
        save_file(_model_state(model), str(tmp / f"model_{tag}.safetensors"))
        skeleton, tensors = flatten_state(optimizer.state_dict(), "optim")
        save_file(tensors, str(tmp / f"optim_{tag}.safetensors"))
        (tmp / f"optim_{tag}.json").write_text(json.dumps(skeleton))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    for name, state in _tracker_states().items():  # dropout inside TP regions draws from these
        rng[f"tracker.{name}"] = state
    save_file(rng, str(tmp / f"rng_rank{rank}.safetensors"))
    _barrier()
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "tp": groups.tp_size,
            "pp": groups.pp_size,
            "dp": groups.dp_size,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "extra": extra or {},
            "config": config or {},
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


def load_checkpoint(
    path: Union[str, Path],
    model: Union[nn.Module, Sequence[nn.Module]],
    optimizer: Any,
    groups: ParallelGroups,
) -> dict:
    """Restore model, optimizer and RNG state from ``path``; returns its meta dict."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path} is not a megatron_logra checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is corrupt: {exc}") from exc
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    if (meta["tp"], meta["pp"]) != (groups.tp_size, groups.pp_size):
        raise CheckpointError(
            f"{path} was saved with tp={meta['tp']} pp={meta['pp']}; this run has tp={groups.tp_size} "
            f"pp={groups.pp_size}"
        )
    tag = f"tp{groups.tp_rank}_pp{groups.pp_rank}"
    needed = [path / f"model_{tag}.safetensors", path / f"optim_{tag}.safetensors", path / f"optim_{tag}.json"]
    missing = [p.name for p in needed if not p.exists()]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}")
    model_tensors = _read_safetensors(needed[0])
    optim_tensors = _read_safetensors(needed[1])
    try:
        skeleton = json.loads(needed[2].read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{needed[2]} is corrupt: {exc}") from exc
    expected = _model_state(model)
    absent = sorted(set(expected) - set(model_tensors))
    if absent:
        raise CheckpointError(f"{needed[0].name} lacks parameters {absent[:4]}")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                saved = model_tensors[f"{i}.{name}"]
                if saved.shape != p.shape:
                    raise CheckpointError(f"parameter {name} has shape {tuple(saved.shape)} in the checkpoint, {tuple(p.shape)} here")
                p.copy_(saved)
    optimizer.load_state_dict(unflatten_state(skeleton, optim_tensors))
    rng_path = path / f"rng_rank{_global_rank()}.safetensors"
    if rng_path.exists():
        rng = _read_safetensors(rng_path)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        tracker = {k[len("tracker."):]: v for k, v in rng.items() if k.startswith("tracker.")}
        if tracker:
            _set_tracker_states(tracker)
    logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta
