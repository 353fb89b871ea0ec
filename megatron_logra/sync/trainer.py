"""Trainer side of sketch-delta sync: build the delta a ``LograOptimizer`` step sends.

Per target the factor is ``U = quantize_factor(α·D)`` (bf16, :func:`local_factors`). The trainer merges
*those* factors into its own weights (``optimizer.apply(update, alpha, factors=...)``) and
ships them gathered to the TP=1 Megatron layout (:func:`build_delta`), so both sides run the
same arithmetic (:func:`megatron_logra.sync.apply.low_rank_merge_`) on the same bf16 numbers::

    update = opt.prepare(num_tokens=n)
    alpha = controller(update)
    factors = local_factors(opt, update, alpha)
    opt.apply(update, alpha, factors=factors)                  # trainer merge
    delta = build_delta(opt, update, alpha, v, v + 1, groups, model=model, factors=factors)
    transport.send(delta)                                      # engine merge

Tensor parallelism (see :mod:`megatron_logra.sketch.capture`): a column-parallel target owns
a block of rows of ``D`` -- the rows are all-gathered over the TP group and un-sharded with the
parameter's ``partition_stride`` (``linear_fc1`` = ``[gate; up]`` has stride 2); a row-parallel
target's ``D`` is already the full, TP-summed direction on every rank, so ``U`` needs no
gather. Pipeline parallelism: each stage builds the part for its own layers;
:func:`merge_deltas` joins the parts. Dense trained parameters (the native AdamW's) travel
full under Hugging Face names; build the delta *after* ``apply`` so they hold the new values.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.models.hf import megatron_param_to_hf
from megatron_logra.models.layout import gather_tp, global_param_names, is_tied_output_copy
from megatron_logra.optim.logra import LograOptimizer
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.parallel import ParallelGroups
from megatron_logra.sync.factors import quantize_factor
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor, expected_layout
from megatron_logra.sync.layout import megatron_rows_from_hf

logger = logging.getLogger(__name__)

__all__ = ["local_factors", "build_delta", "merge_deltas", "attention_dims_of"]


def local_factors(optimizer: LograOptimizer, update: PreparedUpdate, alpha: float) -> dict[str, torch.Tensor]:
    """Target key -> this rank's ``U = quantize_factor(α·D)`` ``[n_out_local, r]`` (bf16 on the exact-sum grid).

    Rows are whole on every rank (column-parallel: own rows; row-parallel: the TP-summed full
    direction), so the per-row grid is the same one a TP=1 trainer would use.
    """
    if update.skipped:
        raise ValueError(f"update {update.step} was skipped ({update.reason}); there is nothing to sync")
    return {k: quantize_factor(d * alpha) for k, d in update.directions.items()}


def attention_dims_of(model: Union[nn.Module, Sequence[nn.Module]]) -> Optional[AttentionDims]:
    """Attention dims from a megatron ``GPTModel``'s ``config`` (None when absent)."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    cfg = getattr(chunk, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not heads:
        return None
    groups = getattr(cfg, "num_query_groups", None) or heads
    head_dim = getattr(cfg, "kv_channels", None) or cfg.hidden_size // heads
    return AttentionDims(int(heads), int(groups), int(head_dim))


def _fused_U(name: str, pieces: dict[str, torch.Tensor], dims: Optional[AttentionDims]) -> torch.Tensor:
    """Megatron-order U of a layer whose targets are HF-split modules (leaf -> U)."""
    if set(pieces) == {"q_proj", "k_proj", "v_proj"}:
        if dims is None:
            raise ValueError(f"fusing {name} from q/k/v needs attention dims (pass dims=)")
        hf = torch.cat([pieces["q_proj"], pieces["k_proj"], pieces["v_proj"]])
        return hf.index_select(0, megatron_rows_from_hf(dims).to(hf.device))
    if set(pieces) == {"gate_proj", "up_proj"}:
        return torch.cat([pieces["gate_proj"], pieces["up_proj"]])
    raise ValueError(f"cannot fuse the targets {sorted(pieces)} of {name}")


@torch.no_grad()
def build_delta(
    optimizer: LograOptimizer,
    update: PreparedUpdate,
    alpha: float,
    base_version: int,
    new_version: int,
    groups: ParallelGroups,
    *,
    model: Optional[Union[nn.Module, Sequence[nn.Module]]] = None,
    dims: Optional[AttentionDims] = None,
    factors: Optional[dict[str, torch.Tensor]] = None,
) -> SketchDelta:
    """The delta of one applied step (this pipeline stage's layers), full TP=1 Megatron layout.

    Collective over the TP group (all ranks must call it). ``factors`` defaults to
    :func:`local_factors`; pass the ones given to ``optimizer.apply`` (they are equal).
    ``model`` is needed for dense trained parameters (names) and, unless ``dims`` is given,
    for the attention dims of fused QKV targets.
    """
    factors = local_factors(optimizer, update, alpha) if factors is None else factors
    cfg = optimizer.cfg
    if dims is None and model is not None:
        dims = attention_dims_of(model)
    fused: dict[str, tuple[int, dict[str, torch.Tensor]]] = defaultdict(lambda: (0, {}))
    targets: list[TargetFactor] = []
    for t in optimizer.targets:
        U_OR = factors[t.key]
        if t.parallel == "column":
            U_OR = gather_tp(U_OR, t.weight, groups.tp)
        if t.key != t.name:  # HF-split modules sharing one canonical layer
            fused[t.name] = (t.n_in, {**fused[t.name][1], t.module_name.split(".")[-1]: U_OR})
            continue
        targets.append(TargetFactor(t.name, U_OR.contiguous(), t.n_in, expected_layout(t.name)))
    for name, (n_in, pieces) in fused.items():
        targets.append(TargetFactor(name, _fused_U(name, pieces, dims).contiguous(), n_in, expected_layout(name)))
    if dims is None and any(t.layout == "qkv_interleaved" for t in targets):
        raise ValueError("fused QKV targets need attention dims: pass dims= or a megatron model with .config")
    dense: dict[str, torch.Tensor] = {}
    natives = list(optimizer.native.params)
    if natives:
        if model is None:
            raise ValueError(f"{len(natives)} trained non-target parameters need model= for their names")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        by_id = {}
        for chunk in chunks:
            names = global_param_names(chunk)
            by_id.update({id(p): (names[n], p) for n, p in chunk.named_parameters()})
        for p in natives:
            if is_tied_output_copy(p):  # the first stage's embedding carries it
                continue
            name, param = by_id[id(p)]
            full = gather_tp(param.detach(), param, groups.tp)
            for hf_name, tensor in megatron_param_to_hf(name, full, dims):
                dense[hf_name] = tensor.detach().cpu().contiguous().clone()
    delta = SketchDelta(
        base_version=base_version, new_version=new_version, seed=cfg.seed, update_index=update.update_index,
        step=update.step, rank=cfg.rank, distribution=cfg.distribution, targets=targets, dense=dense,
        decay=optimizer.weight_decay_factor(update), rounding=optimizer.merge_rounding(), attention=dims,
    )
    delta.check_structure()
    logger.debug("built delta %d->%d: %d targets, %d dense", base_version, new_version, len(targets), len(dense))
    return delta


def merge_deltas(parts: Sequence[SketchDelta]) -> SketchDelta:
    """Join the per-pipeline-stage parts of one step (headers must agree, names must not repeat)."""
    if not parts:
        raise ValueError("no parts to merge")
    first = parts[0]
    key = lambda d: (d.base_version, d.new_version, d.seed, d.update_index, d.rank, d.distribution, d.decay,  # noqa: E731
                     d.step, d.rounding)
    targets: list[TargetFactor] = []
    dense: dict[str, torch.Tensor] = {}
    attention = None
    for d in parts:
        if key(d) != key(first):
            raise ValueError(f"delta parts disagree: {key(d)} vs {key(first)}")
        attention = attention or d.attention
        targets += d.targets
        for k, v in d.dense.items():
            if k in dense:
                raise ValueError(f"dense {k} appears in two parts")
            dense[k] = v
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError("a target appears in two parts")
    merged = SketchDelta(first.base_version, first.new_version, first.seed, first.update_index, first.rank,
                         first.distribution, targets, dense, decay=first.decay, step=first.step, rounding=first.rounding,
                         attention=attention)
    merged.check_structure()
    return merged
