"""Which megatron GPT configs the Megatron <-> HF map supports, and the names and shapes of both sides.

Owns :func:`megatron_shapes` (the full, TP=1-layout megatron state) and :func:`hf_shapes` (the HF causal LM
of the same config, tied head excluded), and the check they and the config export share: a config the map
cannot express (non-SwiGLU MLP, LayerNorm, positions other than RoPE, qk_layernorm with biases) is a
``ValueError`` naming the field. The layout itself (how each name maps to the other side's) is described and
implemented in :mod:`megatron_logra.models.hf`, from which these names stay importable; the converters plan
their files from these shapes before reading any tensor.
"""

from __future__ import annotations

from megatron_logra.models.gpt import ModelConfig


Shape = tuple[int, ...]


def _check_supported(cfg: ModelConfig) -> None:
    if not cfg.swiglu:
        raise ValueError("model.swiglu=False is not supported by the HF mapping (needs a gated SiLU MLP)")
    if cfg.normalization != "RMSNorm":
        raise ValueError(f"model.normalization={cfg.normalization!r} is not supported by the HF mapping (needs RMSNorm)")
    if cfg.position_embedding_type != "rope":
        raise ValueError(
            f"model.position_embedding_type={cfg.position_embedding_type!r} is not supported by the HF mapping (needs rope)"
        )
    if cfg.qk_layernorm and (cfg.add_qkv_bias or cfg.add_bias_linear):
        field = "add_qkv_bias" if cfg.add_qkv_bias else "add_bias_linear"
        raise ValueError(
            f"model.{field}=True together with model.qk_layernorm=True is not supported by the HF mapping "
            "(Qwen3 has biases on q/k/v/o together or not at all)"
        )


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(heads H, query groups G, head dim d, hidden h)."""
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    return heads, groups, cfg.head_dim, cfg.hidden_size


def megatron_shapes(cfg: ModelConfig, tp: int = 1) -> dict[str, Shape]:
    """Names and shapes of the full (TP=1-layout) megatron state of ``cfg``."""
    _check_supported(cfg)
    heads, groups, d, h = _dims(cfg)
    f, v = cfg.ffn_hidden_size, cfg.padded_vocab_size(tp)
    qkv_rows = groups * (heads // groups + 2) * d
    out: dict[str, Shape] = {"embedding.word_embeddings.weight": (v, h)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            out[p + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        if cfg.qk_layernorm:
            out[p + "self_attention.q_layernorm.weight"] = (d,)
            out[p + "self_attention.k_layernorm.weight"] = (d,)
        out[p + "self_attention.linear_proj.weight"] = (h, heads * d)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        out[p + "mlp.linear_fc1.weight"] = (2 * f, h)
        out[p + "mlp.linear_fc2.weight"] = (h, f)
        if cfg.add_bias_linear:
            out[p + "self_attention.linear_proj.bias"] = (h,)
            out[p + "mlp.linear_fc1.bias"] = (2 * f,)
            out[p + "mlp.linear_fc2.bias"] = (h,)
    out["decoder.final_layernorm.weight"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = (v, h)
    return out


def hf_shapes(cfg: ModelConfig, tp: int = 1) -> dict[str, Shape]:
    """Names and shapes of the HF causal LM built from :func:`hf_config_from_model_config` (tied head excluded)."""
    _check_supported(cfg)
    heads, groups, d, h = _dims(cfg)
    f, v = cfg.ffn_hidden_size, cfg.padded_vocab_size(tp)
    out: dict[str, Shape] = {"model.embed_tokens.weight": (v, h)}
    qkv_bias = cfg.add_qkv_bias or cfg.add_bias_linear
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", heads * d), ("k_proj", groups * d), ("v_proj", groups * d)):
            out[p + f"self_attn.{proj}.weight"] = (rows, h)
            if qkv_bias:
                out[p + f"self_attn.{proj}.bias"] = (rows,)
        if cfg.qk_layernorm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "self_attn.o_proj.weight"] = (h, heads * d)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (f, h)
        out[p + "mlp.up_proj.weight"] = (f, h)
        out[p + "mlp.down_proj.weight"] = (h, f)
        if cfg.add_bias_linear:
            out[p + "self_attn.o_proj.bias"] = (h,)
            out[p + "mlp.gate_proj.bias"] = (f,)
            out[p + "mlp.up_proj.bias"] = (f,)
            out[p + "mlp.down_proj.bias"] = (h,)
    out["model.norm.weight"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    return out
