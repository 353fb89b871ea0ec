"""Megatron tensor layouts: global parameter names and TP shard <-> full tensor maps.

A megatron-core parameter carries ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``. With stride ``s`` the full tensor is ``s`` equal blocks along
``partition_dim`` (the gated ``linear_fc1`` is ``[gate; up]``, stride 2) and TP rank ``k``
holds block ``k`` of every one of them, concatenated.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["canonical_param_name", "global_param_names", "shard_full", "unshard", "gather_full_state"]

_LOCAL_LAYER_RE = re.compile(r"^(.*?\bdecoder\.layers\.)(\d+)(\..*)$")

# TransformerEngine's fused norm+linear (TELayerNormColumnParallelLinear) holds the layer's norm
# parameters; global names use the local spec's separate norm modules, so checkpoints, HF
# conversion and sync see one naming whatever ``model.transformer_impl`` is.
_TE_FUSED_NORMS = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".self_attention.linear_qkv.layer_norm_bias": ".input_layernorm.bias",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_bias": ".pre_mlp_layernorm.bias",
}


def canonical_param_name(name: str) -> str:
    """``name`` with TE fused-norm parameters renamed to the local spec's norm parameters."""
    for te_suffix, local_suffix in _TE_FUSED_NORMS.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def global_param_names(model: nn.Module) -> dict[str, str]:
    """Map each parameter name to the same name with the *global* layer index.

    Megatron numbers ``decoder.layers.{i}`` locally per pipeline stage; each
    ``TransformerLayer`` knows its global 1-based ``layer_number``. TransformerEngine's fused
    norm parameters get the local spec's names (:func:`canonical_param_name`).
    """
    offsets: dict[str, int] = {}
    for mname, module in model.named_modules():
        m = _LOCAL_LAYER_RE.match(mname + ".")
        number = getattr(module, "layer_number", None)
        if m and isinstance(number, int) and mname.count(".") == m.group(1).count("."):
            offsets[mname] = number - 1
    out: dict[str, str] = {}
    for pname, _ in model.named_parameters():
        m = _LOCAL_LAYER_RE.match(pname)
        if m is None:
            out[pname] = canonical_param_name(pname)
            continue
        layer_module = m.group(1) + m.group(2)
        index = offsets.get(layer_module, int(m.group(2)))
        out[pname] = canonical_param_name(f"{m.group(1)}{index}{m.group(3)}")
    return out


def _split_dims(param: torch.Tensor) -> tuple[Optional[int], int]:
    if not getattr(param, "tensor_model_parallel", False):
        return None, 1
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))


def shard_full(full: torch.Tensor, name: str, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of ``full`` laid out like ``param``."""
    dim, stride = _split_dims(param)
    if dim is None or tp_size == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp_size, dim=dim)[tp_rank] for b in blocks], dim=dim)


def unshard(shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shard_full` given every rank's shard in TP-rank order."""
    dim, stride = _split_dims(param)
    if dim is None or len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([pr[i] for pr in per_rank], dim=dim) for i in range(stride)], dim=dim)


def gather_full_state(model: nn.Module, tp_group: Optional[dist.ProcessGroup]) -> dict[str, torch.Tensor]:
    """Full (TP-unsharded) fp32 copies of this stage's parameters under global names."""
    names = global_param_names(model)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    out: dict[str, torch.Tensor] = {}
    for pname, param in model.named_parameters():
        local = param.detach().float().contiguous()
        dim, _ = _split_dims(param)
        if dim is not None and tp_size > 1:
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(shards, local, group=tp_group)
            local = unshard(shards, param)
        out[names[pname]] = local.clone()
    return out
