"""Sharded state dicts for megatron-core ``dist_checkpointing``: model and optimizer slots.

The model's sharding comes from megatron-core itself (``GPTModel.sharded_state_dict``: global
layer numbers, tensor-parallel splits, the interleaved QKV and the [gate; up] ``linear_fc1``
factory). Optimizer slots (:class:`~megatron_logra.optim.state.ParamSlot`) reuse the sharding of
their parameter, so every tensor is stored once, as a slice of a global tensor, and can be read
back under any tensor / pipeline / data-parallel layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence, Union

import torch
from torch import nn

from megatron_logra.optim.state import ParamSlot

__all__ = ["model_sharded_state", "param_shardings", "slot_sharded_tensor", "slot_name",
           "optimizer_sharded_state"]


def _chunks(model: Union[nn.Module, Sequence[nn.Module]]) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def model_sharded_state(model: Union[nn.Module, Sequence[nn.Module]]) -> dict:
    """``{"model": sharded dict}`` for one chunk, ``{"model0": ..., "model1": ...}`` for virtual
    pipeline chunks (megatron-LM's convention)."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def param_shardings(model_sharded: dict) -> dict[int, tuple[str, object]]:
    """Parameter ``data_ptr`` -> ``(state-dict name, ShardedTensor / ShardedTensorFactory)`` from
    the model's sharded state dict (entries without a tensor, e.g. ``_extra_state``, are skipped).
    The name is unique per parameter; the sharded key is not (megatron stacks the layers of a
    stage into one global tensor per key)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[int, tuple[str, object]] = {}

    def walk(obj, name: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(obj, (ShardedTensor, ShardedTensorFactory)) and isinstance(obj.data, torch.Tensor):
            out.setdefault(obj.data.data_ptr(), (name, obj))

    walk(model_sharded, "")
    return out


def _rows_like(sh, key: str, rows: torch.Tensor):
    """A ``ShardedTensor`` for a per-row vector of the 2-D weight sharded as ``sh``: stored as a
    ``[n_out, 1]`` global tensor split along the rows exactly like the weight. Where the weight
    is split along its columns (row-parallel layers), every TP rank holds all rows, so the rank
    that owns column block ``j`` is replica ``j``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    data = rows.view(-1, 1)
    if isinstance(sh, ShardedTensorFactory):  # e.g. the [gate; up] split of linear_fc1: rows only
        return replace(sh, key=key, data=data)
    col = sh.prepend_axis_num + 1
    assert len(sh.local_shape) == 2, f"{sh.key}: per-row state needs a 2-D weight, got {sh.local_shape}"
    col_block = sh.global_offset[col] // sh.local_shape[1]
    replica = sh.replica_id
    if sh.axis_fragmentations[col] > 1:
        if isinstance(replica, tuple):
            replica = (replica[0], replica[1] + col_block, *replica[2:])
        else:
            replica = replica + col_block
    out = replace(
        sh, key=key, data=data, dtype=rows.dtype,
        local_shape=(sh.local_shape[0], 1),
        global_shape=(*sh.global_shape[:col], 1),
        global_offset=(*sh.global_offset[:col], 0),
        axis_fragmentations=(*sh.axis_fragmentations[:col], 1),
        replica_id=replica,
    )
    out.validate_metadata_integrity()
    return out


def slot_sharded_tensor(slot: ParamSlot, sh, prefix: str = "optimizer"):
    """The sharded form of one optimizer slot, keyed ``<prefix>.<slot name>.<param key>``."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if slot.like == "rows":
        return _rows_like(sh, f"{prefix}.{slot.name}.{sh.key}", slot.tensor)
    return make_sharded_optimizer_tensor(sh, slot.tensor, f"{prefix}.{slot.name}")


def slot_name(slot: ParamSlot, shardings: dict[int, tuple[str, object]]) -> str:
    """Unique name of a slot in the optimizer's sharded state dict: ``<slot>.<param name>``."""
    entry = shardings.get(slot.param.data_ptr())
    assert entry is not None, f"optimizer slot {slot.name} belongs to a tensor outside the model's state dict"
    return f"{slot.name}.{entry[0]}"


def optimizer_sharded_state(slots: list[ParamSlot], shardings: dict[int, tuple[str, object]]) -> dict:
    """``{slot_name: sharded tensor}`` for all slots. Every slot's parameter must be a model
    parameter (a state tensor that cannot be placed is a bug, not a user error)."""
    out: dict = {}
    for slot in slots:
        name = slot_name(slot, shardings)
        assert name not in out, f"duplicate optimizer slot {name}"
        out[name] = slot_sharded_tensor(slot, shardings[slot.param.data_ptr()][1])
    return out


_DIST = "dist"
"""The checkpoint's subdirectory holding megatron-core's sharded checkpoint (torch_dist backend)."""


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
