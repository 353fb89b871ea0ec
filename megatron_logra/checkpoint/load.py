"""Restore a checkpoint collectively, saved under any TP/PP/DP layout, checking everything first.

The on-disk format and its guarantees are described in :mod:`megatron_logra.checkpoint`; the model and the
optimizer are modified only once the checkpoint's files, pickles, architecture and optimizer settings have
been checked, so a refused checkpoint leaves the run as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence, Union

import torch
from safetensors.torch import load_file
from torch import nn

from megatron_logra.checkpoint.catalog import _STEP_DIR, earlier_checkpoint_hint
from megatron_logra.checkpoint.collective import _one_line
from megatron_logra.checkpoint.compat import architecture_error, architecture_problems, check_compatible
from megatron_logra.checkpoint.integrity import CheckpointError, read_meta, removed_while_read
from megatron_logra.checkpoint.rng import restore_rng
from megatron_logra.checkpoint.sharding import _DIST, _sharded_state
from megatron_logra.parallel import ParallelGroups, group_rank, world_group

logger = logging.getLogger(__name__)

__all__ = ["load_checkpoint"]


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
    training: bool = True,
) -> dict:
    """Restore model, optimizer (``load_sharded_state``) and, for an unchanged layout, RNG
    states from ``path`` — saved under any TP/PP/DP layout. Returns the meta dict. Collective:
    every rank calls it.

    Everything is read and checked before the model or optimizer is modified: :func:`read_meta`
    over the world group (sizes; with ``checksums``, the recorded CRC-32s, each rank checking a
    share of the files — every rank raises the same CheckpointError naming a corrupt file), then,
    given the run's ``model_config`` (``ModelConfig``), its architecture against the checkpoint's
    (:func:`~megatron_logra.checkpoint.compat.check_architecture`: a CheckpointError naming the field, not a tensor shape mismatch).
    Given an ``optimizer``, a weights-only checkpoint is a CheckpointError saying so. ``training=False`` (held-out
    evaluation): a load at another layout is an info line, not a warning (no RNG stream is continued)."""
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
    rng_path = path / f"rng_rank{group_rank(world_group())}.safetensors"
    rng = None
    if same_layout and rng_path.exists():
        try:
            # copies: safetensors maps the file, and megatron's RNG tracker keeps the tensors it is given, which
            # would hold the checkpoint's file mapped (a pruned checkpoint's space, an unmountable share) for good
            rng = {name: t.clone() for name, t in load_file(str(rng_path)).items()}
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
        # training on: the RNG streams differ from the uninterrupted run's; evaluation: nothing is lost
        logger.log(logging.WARNING if training else logging.INFO,
                   "%s was saved at tp=%d pp=%d dp=%d; this run has tp=%d pp=%d dp=%d: %s", path, meta["tp"],
                   meta["pp"], meta["dp"], groups.tp_size, groups.pp_size, groups.dp_size,
                   "weights and optimizer state are resharded, RNG states start fresh" if training
                   else "weights are resharded")
    if groups.is_rank0:
        logger.info("loaded checkpoint %s (step %d)", path, meta["step"])
    return meta
