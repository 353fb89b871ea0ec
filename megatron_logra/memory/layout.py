"""Whether a parallel layout can shard a model: tensor- and pipeline-parallel sizes, LoGRA targets and rank.

megatron-core asserts these when it builds the model; checking them first turns an assertion deep in a
launch into a ``ValueError`` naming the field and the sizes that would work.
"""

from __future__ import annotations

import math

from megatron_logra.memory.plan_config import PlanConfig
from megatron_logra.models.gpt import ModelConfig

__all__ = ["check_split", "check_layout"]


def _divisors_common(*values: int) -> list[int]:
    g = math.gcd(*values)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_split(model: ModelConfig, tp: int, pp: int, *, tp_name: str = "tp", pp_name: str = "pp") -> None:
    """Raise ``ValueError`` naming the fields when ``tp`` does not divide the attention heads, query groups and
    MLP width of ``model`` or ``pp`` its layers (megatron-core asserts these when it builds the model);
    ``tp_name`` / ``pp_name`` are how the message spells the sizes (``parallel.tp`` in a run config)."""
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    ok = _divisors_common(heads, groups, model.ffn_hidden_size)
    for what, value in (("num_attention_heads", heads), ("num_query_groups", groups), ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{tp_name}={tp} must divide model.{what}={value}: choose {tp_name} in {ok}")
    if model.num_layers % pp:
        ok_pp = [d for d in range(1, model.num_layers + 1) if model.num_layers % d == 0]
        raise ValueError(f"{pp_name}={pp} must divide model.num_layers={model.num_layers}: choose {pp_name} in "
                         f"{ok_pp}")


def check_layout(model: ModelConfig, cfg: PlanConfig) -> None:
    """Raise ``ValueError`` naming the field when the layout cannot shard ``model`` (:func:`check_split`,
    then the LoGRA targets and rank)."""
    heads = model.num_attention_heads
    check_split(model, cfg.tp, cfg.pp)
    if cfg.optimizer == "logra":
        if "output_layer" in cfg.targets and not model.untie_embeddings_and_output_weights:
            raise ValueError("targets: output_layer is the word embeddings of this model (tied embeddings); a tied "
                             "output layer cannot be a LoGRA target: untie the embeddings or drop output_layer "
                             "(optimizer.logra.targets)")
        # full input widths of the targets (as the trainer checks them): linear_qkv, linear_fc1 and output_layer
        # read h, linear_proj the attention output a x head_dim (head_dim = kv_channels when set), linear_fc2 the
        # MLP width
        widths = {"linear_qkv": model.hidden_size, "linear_proj": heads * model.head_dim,
                  "linear_fc1": model.hidden_size, "linear_fc2": model.ffn_hidden_size,
                  "output_layer": model.hidden_size}
        name, min_in = min(((k, widths[k]) for k in cfg.targets), key=lambda kv: kv[1])
        if cfg.rank > min_in:
            raise ValueError(f"rank={cfg.rank} must be <= the smallest target input width {min_in} ({name})")
