"""The per-tensor megatron plan: every parameter of the megatron model at a ``(tp, pp)`` layout.

:func:`megatron_plan` lists every tensor of the megatron model at a ``(tp, pp)`` layout: its
global name (TP=1 layout, global layer index), the HF tensors it is made of and how
(``copy``, ``qkv`` fuse, ``fc1`` = ``[gate; up]``, ``vocab`` = rows padded with zeros to the
padded vocabulary), its TP partition ``(dim, stride)`` (megatron-core's
``partition_dim`` / ``partition_stride``), its pipeline stage and its stage-local name, i.e.
exactly what ``build_gpt`` holds on rank ``(tp_rank, pp_rank)``.

:func:`shard` / :func:`place_shard` cut a full tensor into a TP rank's piece and put it back, with
megatron-core's partition rules (:func:`partition_of`) and no model built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Optional

import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import hf_shapes, hf_sources, megatron_shapes
from megatron_logra.models.layout import shard_full

__all__ = ["TensorPlan", "megatron_plan", "partition_of", "check_layout", "hf_expected_shapes", "shard",
           "shard_shape", "place_shard", "IGNORED_HF_SUFFIXES"]

IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
"""HF tensors that are recomputed buffers, not weights (older Llama checkpoints store them)."""


def check_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    """``ValueError`` naming the field when ``cfg`` cannot be split at TP ``tp`` / PP ``pp``."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp={tp} and pp={pp} must be >= 1")
    groups = cfg.num_query_groups or cfg.num_attention_heads
    for field, hf_field, value in (("num_attention_heads", "num_attention_heads", cfg.num_attention_heads),
                                   ("num_query_groups", "num_key_value_heads", groups),
                                   ("ffn_hidden_size", "intermediate_size", cfg.ffn_hidden_size)):
        if value % tp:
            fits = [t for t in range(1, tp) if all(v % t == 0 for v in (cfg.num_attention_heads, groups,
                                                                        cfg.ffn_hidden_size))]
            raise ValueError(f"model.{field}={value} is not divisible by tp={tp} ({hf_field} in a Hugging Face "
                             "config.json; megatron-core splits heads, query groups and the MLP evenly over the TP "
                             f"ranks): use a TP size that divides it, e.g. tp={fits[-1]}")
    if cfg.num_layers % pp:
        fits = [q for q in range(1, pp) if cfg.num_layers % q == 0]
        raise ValueError(f"model.num_layers={cfg.num_layers} is not divisible by pp={pp} (num_hidden_layers in a "
                         f"Hugging Face config.json; every pipeline stage holds as many layers): use a PP size that "
                         f"divides it, e.g. pp={fits[-1]}")


def partition_of(global_name: str) -> Optional[tuple[int, int]]:
    """megatron-core's TP split ``(partition_dim, partition_stride)`` of a parameter, ``None`` if replicated."""
    leaf = global_name.rsplit(".", 1)[-1]
    if global_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0, 1
    if ".self_attention.linear_qkv." in global_name:
        return 0, 1
    if ".mlp.linear_fc1." in global_name:
        return 0, 2
    if leaf == "weight" and (".self_attention.linear_proj." in global_name or ".mlp.linear_fc2." in global_name):
        return 1, 1
    return None


def _fake_param(partition: Optional[tuple[int, int]]) -> SimpleNamespace:
    if partition is None:
        return SimpleNamespace(tensor_model_parallel=False)
    return SimpleNamespace(tensor_model_parallel=True, partition_dim=partition[0], partition_stride=partition[1])


def shard(full: torch.Tensor, partition: Optional[tuple[int, int]], tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``full`` (``layout.shard_full`` with the static partition).

    Stride 1 gives a view (no copy); stride > 1 concatenates the rank's blocks (one shard's worth).
    """
    if partition is not None and partition[1] == 1 and tp > 1:
        dim = partition[0]
        size = full.shape[dim] // tp
        return full.narrow(dim, tp_rank * size, size)
    return shard_full(full, "", _fake_param(partition), tp_rank, tp)


def shard_shape(shape: tuple[int, ...], partition: Optional[tuple[int, int]], tp: int) -> tuple[int, ...]:
    if partition is None or tp == 1:
        return tuple(shape)
    out = list(shape)
    out[partition[0]] //= tp
    return tuple(out)


@dataclass(frozen=True)
class TensorPlan:
    """One megatron parameter of one pipeline stage and the HF tensors it is made of."""

    name: str
    """Global megatron name (TP=1 layout, global layer index)."""
    local_name: str
    """Name in the stage's ``model.named_parameters()`` (stage-local layer index)."""
    pp_rank: int
    sources: tuple[str, ...]
    """HF tensor names, in combine order."""
    kind: str
    """copy | qkv | fc1 | vocab."""
    shape: tuple[int, ...]
    """Full (all TP ranks) shape, padded vocabulary of this layout."""
    partition: Optional[tuple[int, int]]


def hf_expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of ``cfg``'s checkpoint (unpadded vocabulary; no ``lm_head`` when tied)."""
    return hf_shapes(replace(cfg, make_vocab_size_divisible_by=1), tp=1)


def megatron_plan(cfg: ModelConfig, tp: int = 1, pp: int = 1) -> list[TensorPlan]:
    """Every parameter of ``build_gpt(cfg)`` at ``(tp, pp)``, stage by stage, in build order.

    With tied embeddings and ``pp > 1`` the last stage also holds ``output_layer.weight``,
    megatron-core's copy of the word embeddings (source ``model.embed_tokens.weight``).
    """
    check_layout(cfg, tp, pp)
    shapes = megatron_shapes(cfg, tp)
    per_stage = cfg.num_layers // pp
    out: list[TensorPlan] = []
    for name, shape in shapes.items():
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            stage, local = layer // per_stage, f"decoder.layers.{layer % per_stage}." + name.split(".", 3)[3]
        elif name == "embedding.word_embeddings.weight":
            stage, local = 0, name
        else:  # final_layernorm, output_layer
            stage, local = pp - 1, name
        sources = hf_sources(name)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            kind = "vocab"
        elif ".linear_qkv." in name:
            kind = "qkv"
        elif ".linear_fc1." in name:
            kind = "fc1"
        else:
            kind = "copy"
        out.append(TensorPlan(name, local, stage, sources, kind, tuple(shape), partition_of(name)))
    if not cfg.untie_embeddings_and_output_weights and pp > 1:
        emb = shapes["embedding.word_embeddings.weight"]
        out.append(TensorPlan("output_layer.weight", "output_layer.weight", pp - 1, ("model.embed_tokens.weight",),
                              "vocab", tuple(emb), partition_of("output_layer.weight")))
    out.sort(key=lambda t: t.pp_rank)  # stable: build order within a stage
    return out


def place_shard(full: torch.Tensor, piece: torch.Tensor, partition: Optional[tuple[int, int]], tp_rank: int,
                tp: int) -> None:
    """Copy TP rank ``tp_rank``'s shard ``piece`` into its place in ``full`` (inverse of :func:`shard`)."""
    if partition is None or tp == 1:
        full.copy_(piece)
        return
    dim, stride = partition
    block = full.shape[dim] // (stride * tp)
    for i in range(stride):
        full.narrow(dim, (i * tp + tp_rank) * block, block).copy_(piece.narrow(dim, i * block, block))
