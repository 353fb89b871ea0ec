"""Start a megatron model from a Hugging Face checkpoint (or a converted one), at any TP / PP.

Usage (every rank of the job, after ``initialize_parallel``)::

    cfg.model = model_config_from_hf(cfg.model.hf_path, base=cfg.model)   # architecture from config.json
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed)
    load_hf_into_model(model, groups, cfg.model.hf_path, cfg.model)       # this rank's shards only

Each rank reads the checkpoint's headers (validating every shard and the index), then only the
HF tensors of its own pipeline stage, one megatron parameter at a time. Row-split parameters (QKV,
``[gate; up]``, vocabulary) are assembled from only the HF rows this TP rank holds (1/t of their
bytes at TP = t: ``combine.build_shard``); column-split and replicated ones are read whole, fused and
sliced. Shards are copied in (cast to the model's dtype). Peak extra memory is one shard, or one
full column-split parameter. No collective is used; every rank reads the files itself.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from megatron_logra.convert.combine import build_shard
from megatron_logra.convert.hf_checkpoint import HFCheckpoint
from megatron_logra.convert.hf_config import check_same_architecture, model_config_from_hf, model_config_from_hf_dict_strict
from megatron_logra.convert.mcore_checkpoint import McoreCheckpoint, rank_file_name
from megatron_logra.convert.tensor_plan import hf_expected_shapes, megatron_plan, partition_of
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.layout import global_param_names
from megatron_logra.parallel import ParallelGroups

logger = logging.getLogger(__name__)

__all__ = ["load_hf_into_model", "load_mcore_into_model", "model_config_from_hf"]


def _stage_params(model: nn.Module, plan, groups: ParallelGroups, what: str):
    """``[(plan entry, local name, param)]`` of this rank; ``ValueError`` when model and plan disagree."""
    names = global_param_names(model)
    stage = {e.name: e for e in plan if e.pp_rank == groups.pp_rank}
    params = dict(model.named_parameters())
    by_global = {names[local]: local for local in params}
    unknown = sorted(set(by_global) - set(stage))
    missing = sorted(set(stage) - set(by_global))
    if unknown or missing:
        raise ValueError(f"{what}: the model of pipeline stage {groups.pp_rank} does not match the config: "
                         f"parameters without a source {unknown[:8]}, expected but absent {missing[:8]}")
    out = []
    for gname, e in stage.items():
        local = by_global[gname]
        param = params[local]
        actual = (int(param.partition_dim), int(getattr(param, "partition_stride", 1))) \
            if getattr(param, "tensor_model_parallel", False) else None
        if actual != partition_of(gname) and groups.tp_size > 1:
            raise ValueError(f"{what}: parameter {gname} is split as {actual} by megatron-core, the converter "
                             f"expects {partition_of(gname)}")
        out.append((e, local, param))
    return out


@torch.no_grad()
def load_hf_into_model(model: nn.Module, groups: ParallelGroups, hf_dir: Union[str, Path],
                       model_cfg: ModelConfig) -> dict:
    """Load the HF checkpoint ``hf_dir`` into this rank's shards of ``model`` (built from ``model_cfg``).

    ``model_cfg``'s architecture fields must equal the checkpoint's (``model_config_from_hf``);
    every mismatch, missing / unknown / mis-shaped tensor or truncated shard raises ``ValueError``
    naming it. Returns ``{"tensors", "bytes_read", "seconds"}`` of this rank.
    """
    t0 = time.perf_counter()
    if not str(hf_dir) or not Path(hf_dir).is_dir():
        raise ValueError(f"model.hf_path={str(hf_dir)!r} is not a directory (expected a Hugging Face checkpoint)")
    hf_dir = Path(hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    try:
        # the run's own fields (model.seq_length) decide, as when the run's config was read: a sliding window no
        # sequence of the run reaches past is accepted there, whatever the checkpoint's max_position_embeddings
        hf_cfg = model_config_from_hf_dict_strict(ckpt.config, source=str(ckpt.config_path), base=model_cfg)
        check_same_architecture(model_cfg, hf_cfg, str(ckpt.config_path))
        tied = not model_cfg.untie_embeddings_and_output_weights
        ckpt.validate(hf_expected_shapes(model_cfg), tied=tied)
        if tied:
            ckpt.check_tied_head()
        plan = megatron_plan(model_cfg, groups.tp_size, groups.pp_size)
        todo = _stage_params(model, plan, groups, str(hf_dir))
        todo.sort(key=lambda x: min(ckpt.position(s) for s in x[0].sources))
        read = 0

        def counting_read(name: str, out=None, rows=None):
            nonlocal read
            tensor = ckpt.read(name, out=out, rows=rows)
            read += tensor.numel() * tensor.element_size()
            return tensor

        for e, local, param in todo:
            infos = [ckpt.info(s) for s in e.sources]
            dtypes = {i.dtype for i in infos}
            if len(dtypes) > 1:
                raise ValueError(f"{hf_dir}: HF tensors {list(e.sources)} have different dtypes "
                                 f"{sorted(map(str, dtypes))}; they are fused into {e.name}")
            piece = build_shard(e, counting_read, model_cfg, infos[0].dtype, groups.tp_rank, groups.tp_size,
                                source_rows=lambda name: ckpt.info(name).shape[0])
            if tuple(piece.shape) != tuple(param.shape):
                raise ValueError(f"{hf_dir}: {e.name} (from {list(e.sources)}) gives a shard of shape "
                                 f"{list(piece.shape)} at tp={groups.tp_size}, the model holds {list(param.shape)}")
            param.copy_(piece)
            del piece
    finally:
        ckpt.close()
    seconds = time.perf_counter() - t0
    logger.info("loaded %s into tp rank %d / pp rank %d: %d tensors, %.1f MB read in %.1fs", hf_dir, groups.tp_rank,
                groups.pp_rank, len(todo), read / 1e6, seconds)
    return {"tensors": len(todo), "bytes_read": read, "seconds": seconds}


@torch.no_grad()
def load_mcore_into_model(model: nn.Module, groups: ParallelGroups, mcore_dir: Union[str, Path],
                          model_cfg: Optional[ModelConfig] = None, *, verify: bool = True) -> dict:
    """Load this rank's file of a converted (or trainer) checkpoint saved at the same TP / PP.

    Checks the file's sha256 against ``meta.json`` (``verify``), the layout, the architecture
    (when ``model_cfg`` is given) and every name and shape. Returns ``{"tensors", "file"}``.
    """
    src = McoreCheckpoint(mcore_dir, verify=verify)
    try:
        if (src.tp, src.pp) != (groups.tp_size, groups.pp_size):
            raise ValueError(f"{mcore_dir} was converted for tp={src.tp} pp={src.pp}; this run has "
                             f"tp={groups.tp_size} pp={groups.pp_size} (convert again with --tp/--pp, or load the "
                             "HF checkpoint with model.hf_path)")
        if model_cfg is not None:
            check_same_architecture(model_cfg, src.cfg, str(Path(mcore_dir) / "meta.json"))
        plan = megatron_plan(src.cfg, src.tp, src.pp)
        todo = _stage_params(model, plan, groups, str(mcore_dir))
        f = src.file(groups.tp_rank, groups.pp_rank, verify=verify)
        expected = {src.prefix + local for _, local, _ in todo}
        if set(f.tensors) != expected:
            raise ValueError(f"{f.path}: tensors {sorted(set(f.tensors) ^ expected)[:8]} do not match the model")
        for _, local, param in todo:
            tensor = f.read(src.prefix + local)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{f.path}: tensor {local!r} has shape {list(tensor.shape)}, the model holds "
                                 f"{list(param.shape)}")
            param.copy_(tensor)
    finally:
        src.close()
    return {"tensors": len(todo), "file": rank_file_name(groups.tp_rank, groups.pp_rank)}
