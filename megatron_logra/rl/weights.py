"""The trainer's weights as the rollout engine sees them: streamed full tensors and fingerprints.

A dense refit must not hold the whole model at once: at 27B a full fp32 copy is 108 GB, more
than one GPU has. :func:`iter_full_params` therefore yields one full (TP- and PP-unsharded)
parameter at a time, in the parameter's own dtype and in one global name order on every rank:
the TP shards of that parameter are all-gathered, and under pipeline parallelism the stage
that owns it broadcasts it over the PP group. Peak extra memory is the largest parameter.
:func:`iter_hf_params` maps the stream to Hugging Face names (``models.hf``).

:func:`trainer_fingerprint` is the trainer half of the drift check. It moves no full tensor:
for each HF tensor only the rows its fingerprint samples are gathered over TP
(``models.layout.full_rows``), hashed with the one digest definition the engine uses
(``sync.fingerprint.digest``), and the per-stage dicts are exchanged over PP as JSON. The
digest covers the dtype: samples are cast to the engine's dtype first, as refits and deltas are.

Stage exchanges are JSON in byte tensors (no pickle). Tied word embeddings held by the first
and the last stage count once, as the first stage's.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import attention_dims, hf_rows, megatron_param_to_hf
from megatron_logra.models.layout import full_rows, gather_tp, global_param_names, is_tied_output_copy
from megatron_logra.parallel import ParallelGroups, all_gather_bytes, collective_device
from megatron_logra.sync.fingerprint import digest, sampled_rows_of
from megatron_logra.sync.layout import VOCAB_PARALLEL

__all__ = ["iter_full_params", "iter_hf_params", "hf_param_specs", "gather_full_model", "trainer_fingerprint"]


def _exchange_json(obj: dict, group) -> list[dict]:
    return [json.loads(b.decode()) for b in all_gather_bytes(json.dumps(obj).encode(), group)]


def _owned_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters under global names, without the last stage's copy of tied word
    embeddings (the first stage's embedding stands for both, as in a tied HF model)."""
    names = global_param_names(model)
    return {names[n]: p for n, p in model.named_parameters() if not is_tied_output_copy(p)}


def _full_shape(param: torch.Tensor, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[int(param.partition_dim)] *= tp_size
    return shape


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a pipeline stage's parameter list")
    return dtype


def _broadcast_exact(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """``tensor`` from global rank ``src`` on every rank of ``group`` (16-bit types as raw bytes)."""
    raw = tensor.view(torch.uint8) if tensor.element_size() == 2 else tensor
    dist.broadcast(raw, src=src, group=group)
    return raw.view(tensor.dtype) if raw.dtype != tensor.dtype else raw


@torch.no_grad()
def iter_full_params(model: nn.Module, groups: ParallelGroups) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global megatron name, full tensor)`` for every parameter of the whole model, one at a time.

    Sorted by name, identical on every rank of the model-parallel group, which must all consume
    the stream to its end (it runs TP and PP collectives). Tensors keep the parameter's dtype
    and are fresh copies only where a gather or broadcast made them (a replicated parameter at
    PP = 1 is its own ``.detach()``): callers must not write to them.
    """
    owned = _owned_params(model)
    if groups.pp_size == 1:
        for name in sorted(owned):
            param = owned[name]
            yield name, gather_tp(param.detach(), param, groups.tp)
        return
    me = dist.get_rank()
    metas = _exchange_json({"rank": me, "params": {n: [_full_shape(p, groups.tp_size), str(p.dtype)]
                                                    for n, p in owned.items()}},
                           groups.pp)
    owner: dict[str, tuple[int, list[int], str]] = {}
    for meta in metas:
        for name, (shape, dtype) in meta["params"].items():
            if name in owner:
                raise RuntimeError(f"parameter {name} is owned by more than one pipeline stage")
            owner[name] = (int(meta["rank"]), shape, dtype)
    device = collective_device(groups.pp)
    for name in sorted(owner):
        src, shape, dtype = owner[name]
        if src == me:
            param = owned[name]
            full = gather_tp(param.detach(), param, groups.tp).to(device).contiguous()
        else:
            full = torch.empty(shape, dtype=_dtype(dtype), device=device)
        yield name, _broadcast_exact(full, src, groups.pp)


def iter_hf_params(model: nn.Module, groups: ParallelGroups, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_full_params` under Hugging Face names (q/k/v and gate/up split; see ``models.hf``).
    Same contract: read-only tensors, consume to the end on every rank."""
    dims = attention_dims(cfg)
    for name, full in iter_full_params(model, groups):
        for hf_name, rows in hf_rows(name, full.shape[0], dims):  # no copy where a rename is all it takes
            yield hf_name, full if rows is None else full.index_select(0, rows.to(full.device))


def hf_param_specs(model: nn.Module, groups: ParallelGroups, cfg: ModelConfig) -> list[tuple[str, list[int]]]:
    """``(HF name, full shape)`` of every tensor :func:`iter_hf_params` yields, in its order, without moving
    any tensor (so a writer can lay out a file before the stream starts). Under pipeline parallelism the
    stages exchange their parameter lists (a collective over the PP group: every rank of it must call)."""
    shapes = {name: _full_shape(p, groups.tp_size) for name, p in _owned_params(model).items()}
    if groups.pp_size > 1:
        merged: dict[str, list[int]] = {}
        for part in _exchange_json(shapes, groups.pp):
            merged.update(part)
        shapes = merged
    dims = attention_dims(cfg)
    out: list[tuple[str, list[int]]] = []
    for name in sorted(shapes):
        shape = list(shapes[name])
        for hf_name, rows in hf_rows(name, shape[0] if shape else 0, dims):
            out.append((hf_name, shape if rows is None else [len(rows), *shape[1:]]))
    return out


def gather_full_model(model: nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model (all stages), full size, fp32, megatron global names.

    Holds the whole model: for small models, tests and checkpoint export. Refits and drift
    checks stream instead (:func:`iter_hf_params`, :func:`trainer_fingerprint`).
    """
    return {name: full.float().clone() for name, full in iter_full_params(model, groups)}


@torch.no_grad()
def trainer_fingerprint(model: nn.Module, groups: ParallelGroups, cfg: ModelConfig,
                        rows_per_tensor: int = 4, dtype: Optional[torch.dtype] = None,
                        vocab_rows: Optional[int] = None, salt: Optional[int] = None) -> dict[str, str]:
    """``{HF name: digest}`` of the whole model, equal to ``sync.fingerprint.fingerprint`` of its
    full HF tensors cast to ``dtype`` (the engine's; None keeps each parameter's), from row
    samples only (see the module docstring). Every rank of the model-parallel group must call;
    all get the same dict.

    The cast matters where the trainer keeps some parameters wider than its compute dtype
    (megatron's fp32 norms in a bf16 model): the engine holds them rounded, as every refit and
    delta casts to the engine's dtype, and the fingerprint compares exactly that.

    ``vocab_rows``: the engine's vocabulary when it serves fewer ids than the trainer's padded
    vocabulary (SGLang started from the unpadded checkpoint). The vocab-parallel tensors
    (``embed_tokens``, ``lm_head``) are then fingerprinted as their first ``vocab_rows`` rows,
    the tensors that engine holds; None (or the padded size) fingerprints every row.

    ``salt``: sample the rows with this salt (``sync.fingerprint``; policy sync passes the salt of the
    engine's fingerprint, its weight version, so successive checks sweep every row). The same on
    every rank.
    """
    dims = attention_dims(cfg)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if dtype is None else t.to(dtype)

    local: dict[str, str] = {}
    for name, param in sorted(_owned_params(model).items()):
        full_shape = _full_shape(param, groups.tp_size)
        if param.dim() <= 1:  # biases and norms: whole (and small)
            for hf_name, t in megatron_param_to_hf(name, gather_tp(param.detach(), param, groups.tp), dims):
                rows = sampled_rows_of(hf_name, t.shape, rows_per_tensor, salt)
                t = cast(t)
                local[hf_name] = digest(hf_name, t.dtype, t.shape, rows, t.reshape(1, -1), salt)
            continue
        for hf_name, meg_rows in hf_rows(name, full_shape[0], dims):
            hf_shape = [full_shape[0] if meg_rows is None else len(meg_rows), *full_shape[1:]]
            if vocab_rows is not None and hf_name in VOCAB_PARALLEL:
                if not 0 < vocab_rows <= hf_shape[0]:
                    raise ValueError(f"{hf_name}: the engine serves {vocab_rows} vocabulary rows, "
                                     f"the trainer holds {hf_shape[0]}")
                hf_shape[0] = vocab_rows
            rows = sampled_rows_of(hf_name, hf_shape, rows_per_tensor, salt)
            wanted = rows if meg_rows is None else meg_rows[rows].tolist()
            sample = cast(full_rows(param, wanted, groups.tp).reshape(len(rows), -1))
            local[hf_name] = digest(hf_name, sample.dtype, hf_shape, rows, sample, salt)
    if groups.pp_size == 1:
        return dict(sorted(local.items()))
    merged: dict[str, str] = {}
    for part in _exchange_json(local, groups.pp):
        merged.update(part)
    return dict(sorted(merged.items()))

