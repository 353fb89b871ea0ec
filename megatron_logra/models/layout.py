"""Megatron tensor layouts: global parameter names and TP shard <-> full tensor maps.

A megatron-core parameter carries ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``. With stride ``s`` the full tensor is ``s`` equal blocks along
``partition_dim`` (the gated ``linear_fc1`` is ``[gate; up]``, stride 2) and TP rank ``k``
holds block ``k`` of every one of them, concatenated.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["canonical_param_name", "global_param_names", "is_tied_output_copy", "shard_full", "unshard", "gather_tp", "full_rows",
           "gather_full_state"]

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


def is_tied_output_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` is the last pipeline stage's copy of tied word embeddings.

    Under pipeline parallelism with tied embeddings megatron gives the last stage its own
    ``output_layer.weight``, marked ``shared``, kept equal to the first stage's
    ``embedding.word_embeddings.weight`` (same init, gradients summed over the embedding group).
    The first stage's tensor is the one that is exported, synced and counted."""
    return bool(getattr(param, "shared", False))


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


def _tp_size(tp_group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1


def _all_gather_exact(local: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """Every rank's ``local`` bit for bit; 16-bit tensors travel as raw bytes (gloo has no bf16 all-gather)."""
    raw = local.contiguous().view(torch.uint8) if local.element_size() == 2 else local.contiguous()
    shards = [torch.empty_like(raw) for _ in range(_tp_size(tp_group))]
    dist.all_gather(shards, raw, group=tp_group)
    return [s.view(local.dtype) if s.dtype != local.dtype else s for s in shards]


def gather_tp(local: torch.Tensor, param: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The full tensor from this rank's shard ``local`` laid out like ``param``, in ``local``'s dtype.

    Bitwise: no casts, the byte view keeps every block boundary on an element boundary.
    A replicated ``param`` (or a group of one) returns ``local`` itself.
    """
    dim, _ = _split_dims(param)
    if dim is None or _tp_size(tp_group) == 1:
        return local
    return unshard(_all_gather_exact(local, tp_group), param)


def full_rows(param: torch.Tensor, rows: Sequence[int], tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Rows ``rows`` (indices into dim 0 of the *full* tensor) of a TP-sharded 2-D ``param``, ``[len(rows), n_in]``.

    Moves only those rows: a column-parallel parameter (``partition_dim`` 0, any stride) sends a
    ``[len(rows), n_in]`` buffer per rank in which each rank fills the rows it owns; a
    row-parallel one (``partition_dim`` 1) sends its column block of the rows. Bitwise equal
    to ``gather_tp(param)[rows]``. Every rank of ``tp_group`` must call with the same ``rows``.
    """
    local = param.detach()
    idx = torch.as_tensor(list(rows), dtype=torch.int64, device=local.device)
    dim, stride = _split_dims(param)
    size = _tp_size(tp_group)
    if dim is None or size == 1:
        return local.index_select(0, idx)
    if dim == 1:
        return unshard(_all_gather_exact(local.index_select(0, idx), tp_group), param)
    rank = dist.get_rank(tp_group)
    block = local.shape[0] * size // stride  # rows per stride block of the full tensor
    piece = block // size  # rows per rank within a block
    offset = idx % block
    owner = offset // piece
    local_row = (idx // block) * piece + offset % piece
    buf = torch.zeros(len(idx), *local.shape[1:], dtype=local.dtype, device=local.device)
    mine = (owner == rank).nonzero().flatten()
    buf[mine] = local.index_select(0, local_row[mine])
    gathered = torch.stack(_all_gather_exact(buf, tp_group))  # [tp, rows, n_in]
    return gathered[owner, torch.arange(len(idx), device=local.device)]


def gather_full_state(model: nn.Module, tp_group: Optional[dist.ProcessGroup]) -> dict[str, torch.Tensor]:
    """Full (TP-unsharded) fp32 copies of this stage's parameters under global names."""
    names = global_param_names(model)
    return {names[pname]: gather_tp(param.detach(), param, tp_group).float().clone()
            for pname, param in model.named_parameters()}
