"""Layout-invariant initialisation of a megatron-core GPT, and which global weight each parameter holds.

:func:`init_layout_invariant_` gives every parameter values that depend only on the seed and the parameter's
*global* name, never on TP/PP layout, so runs at different parallel layouts start from identical weights (the
basis of the TP/PP/DP equivalence tests). :func:`set_skipped_tp_attributes` marks the TP-split weights when
megatron-core's own initialisers are skipped (a model whose weights are loaded next).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from megatron_logra.models.config import ModelConfig
from megatron_logra.models.layout import global_param_names, shard_full
from megatron_logra.parallel import ParallelGroups

__all__ = ["init_layout_invariant_", "set_skipped_tp_attributes", "weight_source_name", "WORD_EMBEDDINGS",
           "OUTPUT_WEIGHT"]


def set_skipped_tp_attributes(model: nn.Module) -> None:
    """Mark the TP-split weights of megatron-core's own layers as its initialisers would have.

    megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` on a
    ``ColumnParallelLinear``, ``RowParallelLinear`` or ``VocabParallelEmbedding`` weight only inside
    its initialisers, which ``perform_initialization=False`` skips; without them every gather,
    checkpoint load and refit would take the TP shards for replicated tensors. Column-parallel
    weights split rows (``linear_fc1`` of a gated MLP with stride 2: each rank holds its
    [gate; up] slice, as megatron's MLP builds it), row-parallel weights split columns, the
    vocabulary embedding splits rows. TransformerEngine layers set theirs in any case and are
    left alone, as is any weight that already carries them.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    config = getattr(model, "config", None)
    gated = bool(getattr(config, "gated_linear_unit", False)) and not getattr(config, "use_kitchen", False)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, VocabParallelEmbedding):
            dim, stride = 0, 1
        elif isinstance(module, ColumnParallelLinear):
            dim, stride = 0, (2 if gated and name.rsplit(".", 1)[-1] == "linear_fc1" else 1)
        elif isinstance(module, RowParallelLinear):
            dim, stride = 1, 1
        else:
            continue
        set_tensor_model_parallel_attributes(weight, True, dim, stride)


WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"


def weight_source_name(model: nn.Module, global_name: str) -> str:
    """The global name whose values parameter ``global_name`` of ``model`` must hold.

    With tied embeddings (``untie_embeddings_and_output_weights=False``) and PP > 1, megatron keeps a
    copy of the word embeddings on the last stage as ``output_layer.weight``; that copy must always
    equal the first stage's ``embedding.word_embeddings.weight`` (megatron-core's
    ``setup_embeddings_and_output_layer`` copies it at build, the native optimizer sums the two
    copies' gradients over the embedding group). Every initialisation and every load fills it from
    :data:`WORD_EMBEDDINGS`; every other parameter (and an untied output layer) is its own source.
    At PP = 1 a tied model has no ``output_layer.weight`` parameter at all.
    """
    if global_name == OUTPUT_WEIGHT and getattr(model, "share_embeddings_and_output_weights", False):
        return WORD_EMBEDDINGS
    return global_name


def _param_seed(seed: int, global_name: str) -> int:
    digest = hashlib.blake2b(f"logra-init|{seed}|{global_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_layout_invariant_(model: nn.Module, cfg: ModelConfig, groups: ParallelGroups, *, seed: int = 1234) -> None:
    """Re-initialise every parameter from ``(seed, global name)`` and take this rank's TP shard.

    Norm weights -> 1, biases -> 0, matrices -> N(0, init_std²) (output projections scaled by
    1/sqrt(2·num_layers) as in Megatron). The padded vocabulary rows are generated at the
    padded size of TP=1 ... so they are also identical across TP, except for extra padding.

    The last stage's copy of tied word embeddings (PP > 1) is drawn as the word embeddings
    themselves (:func:`weight_source_name`), so it equals the first stage's values bit for bit,
    as megatron-core's own build leaves it, without a collective: a tied model at PP = 2 starts
    exactly as the same model at PP = 1.
    """
    names = global_param_names(model)
    for local_name, param in model.named_parameters():
        gname = weight_source_name(model, names[local_name])
        leaf = gname.split(".")[-1]
        if "norm" in gname.split(".")[-2] or gname.endswith("layer_norm_weight"):
            param.fill_(1.0)
            continue
        if leaf == "bias" or gname.endswith("layer_norm_bias"):
            param.zero_()
            continue
        full_shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            full_shape[param.partition_dim] *= groups.tp_size
        std = cfg.init_std
        if gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
        gen = torch.Generator().manual_seed(_param_seed(seed, gname))
        full = torch.randn(full_shape, generator=gen, dtype=torch.float32) * std
        param.copy_(shard_full(full, gname, param, groups.tp_rank, groups.tp_size))
