"""HF-compatible configs and the Megatron <-> HF (Llama / Qwen2 / Qwen3) parameter layout map.

Megatron side: a *full* state in the TP=1 layout with global layer indices, exactly as
:func:`megatron_logra.models.layout.gather_full_state` returns it (megatron-core local spec names)::

    embedding.word_embeddings.weight                   [V, h]
    decoder.layers.{i}.input_layernorm.weight          [h]
    decoder.layers.{i}.self_attention.linear_qkv.weight [G·(H/G + 2)·d, h]  (+ .bias)
    decoder.layers.{i}.self_attention.q_layernorm.weight [d]   (qk_layernorm)
    decoder.layers.{i}.self_attention.k_layernorm.weight [d]   (qk_layernorm)
    decoder.layers.{i}.self_attention.linear_proj.weight [h, H·d]  (+ .bias)
    decoder.layers.{i}.pre_mlp_layernorm.weight        [h]
    decoder.layers.{i}.mlp.linear_fc1.weight           [2·f, h] = [gate; up]  (+ .bias)
    decoder.layers.{i}.mlp.linear_fc2.weight           [h, f]  (+ .bias)
    decoder.final_layernorm.weight                     [h]
    output_layer.weight                                [V, h]  (untied only)

with ``V`` the padded vocabulary, ``H`` query heads, ``G`` query groups, ``d`` head dim.
The fused QKV rows are interleaved per query group: group ``g`` holds
``[q heads of g (H/G·d rows); k (d rows); v (d rows)]``.

HF side: ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``self_attn.{q,k}_norm`` (Qwen3), ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``, ``model.norm`` and ``lm_head`` (absent when tied).

Both directions are pure functions: only reshapes, slices and concatenations (bitwise
round trip); outputs never alias inputs; unknown, missing or mis-shaped names raise
``ValueError`` listing them. The names and shapes of both sides, and which configs the map supports, live in
:mod:`megatron_logra.models.hf_shapes` (importable from here).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf_shapes import Shape, _check_supported, _dims, hf_shapes, megatron_shapes
from megatron_logra.sync.codec import AttentionDims
from megatron_logra.sync.layout import qkv_rows_hf

if TYPE_CHECKING:  # transformers is imported lazily (heavy import)
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

__all__ = ["hf_config_from_model_config", "megatron_to_hf", "hf_to_megatron", "megatron_shapes", "hf_shapes",
           "hf_sources", "attention_dims", "hf_rows", "megatron_param_to_hf"]


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` of ``cfg``: unscaled, or Llama 3 scaling by ``model.rope_scaling_factor``
    (with the constants megatron-core builds it with, :data:`~megatron_logra.models.presets.LLAMA3_ROPE_FIELDS`)."""
    from megatron_logra.models.presets import LLAMA3_ROPE_FIELDS

    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    return {"rope_type": "llama3", "rope_theta": float(cfg.rotary_base), "factor": float(cfg.rope_scaling_factor),
            **LLAMA3_ROPE_FIELDS}


def hf_config_from_model_config(cfg: ModelConfig, tp: int = 1) -> "PretrainedConfig":
    """A transformers config whose causal LM has exactly the shapes of ``cfg``'s megatron GPT.

    ``LlamaConfig`` by default (``add_bias_linear`` -> ``attention_bias`` and ``mlp_bias``),
    ``Qwen2Config`` for ``add_qkv_bias`` alone, ``Qwen3Config`` for ``qk_layernorm``. The
    vocabulary is ``cfg.padded_vocab_size(tp)`` so embedding shapes match the megatron model.
    Raises ``ValueError`` naming the field for configurations HF cannot express
    (non-SwiGLU MLP, LayerNorm, non-rope positions, qk_layernorm with biases).
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    _check_supported(cfg)
    heads, groups, head_dim, hidden = _dims(cfg)
    common = dict(
        vocab_size=cfg.padded_vocab_size(tp),
        hidden_size=hidden,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_length,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.layernorm_epsilon,
        rope_parameters=hf_rope_parameters(cfg),
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if cfg.qk_layernorm:
        out = Qwen3Config(attention_bias=False, use_sliding_window=False, **common)
    elif cfg.add_bias_linear:
        out = LlamaConfig(attention_bias=True, mlp_bias=True, **common)
    elif cfg.add_qkv_bias:
        out = Qwen2Config(use_sliding_window=False, **common)
    else:
        out = LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    logger.debug("HF config %s for %s", type(out).__name__, cfg)
    return out


def _validate(state: dict[str, torch.Tensor], expected: dict[str, Shape], what: str) -> None:
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown or missing:
        raise ValueError(f"{what} state does not match the model config: unknown names {unknown}, missing names {missing}")
    bad = [f"{k}: {tuple(state[k].shape)} != {expected[k]}" for k in expected if tuple(state[k].shape) != expected[k]]
    if bad:
        raise ValueError(f"{what} state has wrong shapes: {bad}")


# Renames that are 1:1 (per layer, then global), megatron suffix -> HF suffix.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_sources(megatron_name: str) -> tuple[str, ...]:
    """HF names whose tensors make up the full megatron parameter ``megatron_name`` (global layer index).

    One name for 1:1 renames; ``(q_proj, k_proj, v_proj)`` for ``linear_qkv`` (combine with
    :func:`fuse_qkv`); ``(gate_proj, up_proj)`` for ``linear_fc1`` (concatenate along rows).
    ``ValueError`` for a name this map does not know.
    """
    if megatron_name in _GLOBAL_RENAMES:
        return (_GLOBAL_RENAMES[megatron_name],)
    parts = megatron_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        suffix, pre = parts[3], f"model.layers.{parts[2]}."
        if suffix in _LAYER_RENAMES:
            return (pre + _LAYER_RENAMES[suffix],)
        module, _, leaf = suffix.rpartition(".")
        if module == "self_attention.linear_qkv" and leaf in ("weight", "bias"):
            return tuple(pre + f"self_attn.{x}_proj.{leaf}" for x in "qkv")
        if module == "mlp.linear_fc1" and leaf in ("weight", "bias"):
            return (pre + f"mlp.gate_proj.{leaf}", pre + f"mlp.up_proj.{leaf}")
    raise ValueError(f"no HF mapping for megatron parameter {megatron_name!r}")


def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split megatron's per-group interleaved ``linear_qkv`` rows (weight ``[R, h]`` or bias ``[R]``) into q, k, v.

    Returns ``q`` ``[H·d, ...]``, ``k`` and ``v`` ``[G·d, ...]`` (contiguous copies).
    """
    heads, groups, d, _ = _dims(cfg)
    per = heads // groups
    grouped = fused.reshape(groups, per + 2, d, *fused.shape[1:])
    q = grouped[:, :per].reshape(heads * d, *fused.shape[1:])
    k = grouped[:, per].reshape(groups * d, *fused.shape[1:])
    v = grouped[:, per + 1].reshape(groups * d, *fused.shape[1:])
    return q.clone(), k.clone(), v.clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    heads, groups, d, _ = _dims(cfg)
    per = heads // groups
    rest = tuple(q.shape[1:])
    parts = [q.reshape(groups, per, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(groups * (per + 2) * d, *rest)


def attention_dims(cfg: ModelConfig) -> AttentionDims:
    """``cfg``'s attention shape (heads, query groups, head dim), as the QKV row maps take it."""
    heads, groups, d, _ = _dims(cfg)
    return AttentionDims(heads, groups, d)


def hf_rows(megatron_name: str, num_rows: int, dims: Optional[AttentionDims]) -> list[tuple[str, Optional[torch.Tensor]]]:
    """The HF tensors one full megatron parameter (global name, ``num_rows`` rows) maps to.

    Each entry is ``(hf_name, rows)``: the megatron rows the HF tensor takes, in HF order, or
    None for all of them unchanged. ``linear_qkv`` splits into q/k/v by the per-group
    interleave (needs ``dims``), ``linear_fc1`` into its ``[gate; up]`` halves. This is the
    one row map that full conversion (:func:`megatron_param_to_hf`) and row-sampled
    fingerprints of sharded weights share. ``ValueError`` for an unknown name.
    """
    sources = hf_sources(megatron_name)
    if len(sources) == 1:
        return [(sources[0], None)]
    if len(sources) == 3:
        if dims is None:
            raise ValueError(f"splitting {megatron_name} into q/k/v needs attention dims")
        if dims.qkv_rows != num_rows:
            raise ValueError(f"{megatron_name}: {num_rows} rows, attention dims {dims} imply {dims.qkv_rows}")
        parts = qkv_rows_hf(dims)
        return [(name, parts[p]) for name, p in zip(sources, "qkv")]
    gate, up = torch.arange(num_rows, dtype=torch.int64).chunk(2)
    return [(sources[0], gate), (sources[1], up)]


def megatron_param_to_hf(name: str, tensor: torch.Tensor, dims: Optional[AttentionDims]) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of one full megatron parameter (copies; dtype kept). See :func:`hf_rows`."""
    return [(hf, tensor.clone() if rows is None else tensor.index_select(0, rows.to(tensor.device)))
            for hf, rows in hf_rows(name, tensor.shape[0], dims)]


def megatron_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, *, tp: int = 1) -> dict[str, torch.Tensor]:
    """Map a full (TP=1-layout, global layer index) megatron GPT state to HF causal-LM names.

    ``state`` must hold exactly the names of :func:`megatron_shapes` ``(cfg, tp)`` with those
    shapes (else ``ValueError`` listing unknown / missing / mis-shaped names); ``tp`` is the
    trainer's TP degree, which fixes the padded vocabulary. Dtypes are kept.
    """
    _validate(state, megatron_shapes(cfg, tp), "megatron")
    dims = attention_dims(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out.update(megatron_param_to_hf(name, tensor, dims))
    return out


def hf_to_megatron(hf_state: dict[str, torch.Tensor], cfg: ModelConfig, *, tp: int = 1) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_to_hf` (bitwise): HF causal-LM names -> full megatron state.

    ``hf_state`` must hold exactly the names of :func:`hf_shapes` ``(cfg, tp)`` (a tied model
    has no ``lm_head.weight``), else ``ValueError`` listing unknown / missing / mis-shaped names.
    """
    _validate(hf_state, hf_shapes(cfg, tp), "HF")
    inv_layer = {v: k for k, v in _LAYER_RENAMES.items()}
    inv_global = {v: k for k, v in _GLOBAL_RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name in inv_global:
            out[inv_global[name]] = tensor.clone()
            continue
        _, _, layer, suffix = name.split(".", 3)
        p = f"decoder.layers.{layer}."
        if suffix in inv_layer:
            out[p + inv_layer[suffix]] = tensor.clone()
            continue
        module, leaf = suffix.rsplit(".", 1)
        pre = f"model.layers.{layer}."
        if module == "self_attn.q_proj":
            q, k, v = (hf_state[pre + f"self_attn.{x}_proj.{leaf}"] for x in "qkv")
            out[p + f"self_attention.linear_qkv.{leaf}"] = fuse_qkv(q, k, v, cfg)
        elif module == "mlp.gate_proj":
            gate, up = hf_state[pre + f"mlp.gate_proj.{leaf}"], hf_state[pre + f"mlp.up_proj.{leaf}"]
            out[p + f"mlp.linear_fc1.{leaf}"] = torch.cat([gate, up], dim=0)
        elif module not in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
            raise ValueError(f"no megatron mapping for HF parameter {name!r}")
    return out
