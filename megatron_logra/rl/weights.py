"""Full (TP- and PP-unsharded) copies of the trainer's weights, on every rank.

Used for the dense "full refit" of rollout engines. TP shards are all-gathered
(``models.layout.gather_full_state``); pipeline stages exchange their parameter names and
shapes as JSON in a byte tensor (no pickle), then sum zero-filled copies over the PP group,
so each parameter comes from exactly the one stage that owns it.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.models.layout import gather_full_state
from megatron_logra.parallel import ParallelGroups, all_gather_bytes, all_reduce_sum

__all__ = ["gather_full_model"]


def _exchange_json(obj: dict, group) -> list[dict]:
    return [json.loads(b.decode()) for b in all_gather_bytes(json.dumps(obj).encode(), group)]


@torch.no_grad()
def gather_full_model(model: nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model (all stages), full size, fp32, megatron global names."""
    local = gather_full_state(model, groups.tp)
    if groups.pp_size == 1:
        return local
    device = next(iter(local.values())).device
    # word embeddings may live on the first and the last stage (tied): keep the first stage's
    if not groups.pp_first:
        local.pop("embedding.word_embeddings.weight", None)
    metas = _exchange_json({k: list(v.shape) for k, v in local.items()}, groups.pp)
    names: dict[str, list[int]] = {}
    for meta in metas:
        for k, shape in meta.items():
            if k in names:
                raise RuntimeError(f"parameter {k} is owned by more than one pipeline stage")
            names[k] = shape
    full: dict[str, torch.Tensor] = {}
    for k in sorted(names):
        t = local.get(k)
        full[k] = t.clone() if t is not None else torch.zeros(names[k], dtype=torch.float32, device=device)
    flat = torch.cat([full[k].reshape(-1) for k in sorted(full)])
    all_reduce_sum(flat, groups.pp)
    offset = 0
    for k in sorted(full):
        n = full[k].numel()
        full[k] = flat[offset : offset + n].view_as(full[k]).clone()
        offset += n
    return full
