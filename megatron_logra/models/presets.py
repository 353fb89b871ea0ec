"""Named model shapes (Qwen2.5 1.5B / 7B and a 27B-class shape) and a Hugging Face ``config.json`` loader.

Presets are plain :class:`~megatron_logra.models.gpt.ModelConfig` objects (bf16 parameters,
sequence length 4096 unless told otherwise), used by the memory planner and by anyone who
wants the real shapes of a model without its weights.

``27b`` is a Gemma-3-27B-like shape whose head dimension is left at ``hidden_size /
num_attention_heads`` (5376 / 32 = 168) instead of Gemma's 128 (``kv_channels=128``), so that its
figures stay comparable with the published tables and err on the large side. Everything else follows Gemma 3 27B (hidden 5376,
62 layers, 32 query heads, 16 KV groups, SwiGLU width 21504, vocabulary 262144, tied
embeddings). The wider heads give 28.3 B parameters instead of Gemma's 27.0 B text weights,
so memory figures for it are slightly conservative. 32 heads and 16 groups allow TP 1-16.

:func:`load_hf_config` reads a ``config.json`` of a Llama, Mistral, Qwen2 or Qwen3 causal LM
(``architectures`` / ``model_type``) as transformers reads it (its ``head_dim`` default, its RoPE-base
precedence) and rejects anything else, a field ``ModelConfig`` cannot express (a non-SiLU MLP, ...) or
a value of the wrong type (null, a string for a number or boolean), with a ``ValueError`` naming the
field. Its typed field readers live in :mod:`megatron_logra.models.hf_fields` and its RoPE fields in
:mod:`megatron_logra.models.hf_rope` (both importable from here).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Union

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf_fields import _optional_int, _positive_number, _require, hf_bool, read_json_object
from megatron_logra.models.hf_rope import LLAMA3_ROPE_FIELDS, hf_rope_scaling_factor, hf_rope_theta

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "get_preset", "load_hf_config", "resolve_model", "preset_names",
           # re-exported from models.hf_fields / models.hf_rope, where they live
           "hf_bool", "read_json_object", "LLAMA3_ROPE_FIELDS", "hf_rope_scaling_factor", "hf_rope_theta"]

DEFAULT_SEQ_LENGTH = 4096


def _qwen25_1_5b() -> ModelConfig:
    """Qwen2.5-1.5B (1.54 B parameters, tied embeddings, QKV bias)."""
    return ModelConfig(
        num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960,
        vocab_size=151936, seq_length=DEFAULT_SEQ_LENGTH, swiglu=True, add_qkv_bias=True,
        untie_embeddings_and_output_weights=False, rotary_base=1000000, params_dtype="bfloat16",
    )


def _qwen25_7b() -> ModelConfig:
    """Qwen2.5-7B (7.62 B parameters, untied embeddings, QKV bias)."""
    return ModelConfig(
        num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4, ffn_hidden_size=18944,
        vocab_size=152064, seq_length=DEFAULT_SEQ_LENGTH, swiglu=True, add_qkv_bias=True,
        untie_embeddings_and_output_weights=True, rotary_base=1000000, params_dtype="bfloat16",
    )


def _gemma_like_27b() -> ModelConfig:
    """27B-class, Gemma-3-27B-like shape with head dim 168 (28.3 B parameters, tied embeddings)."""
    return ModelConfig(
        num_layers=62, hidden_size=5376, num_attention_heads=32, num_query_groups=16, ffn_hidden_size=21504,
        vocab_size=262144, seq_length=DEFAULT_SEQ_LENGTH, swiglu=True, add_qkv_bias=False,
        untie_embeddings_and_output_weights=False, rotary_base=1000000, params_dtype="bfloat16",
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "qwen2.5-1.5b": _qwen25_1_5b,
    "qwen2.5-7b": _qwen25_7b,
    "27b": _gemma_like_27b,
}
"""Preset name -> factory of a fresh ``ModelConfig``."""


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, *, seq_length: Optional[int] = None) -> ModelConfig:
    """A fresh ``ModelConfig`` of the preset ``name`` (optionally with another ``seq_length``)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"model={name!r} is not a preset: choose one of {', '.join(PRESETS)} or a path to a config.json")
    cfg = PRESETS[key]()
    return replace(cfg, seq_length=seq_length) if seq_length else cfg


# ------------------------------------------------------------------ Hugging Face config.json
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = set(_ARCHITECTURES.values())
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16",
                 "float": "float32"}


def _family(raw: dict, source: str) -> str:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    known = [a for a in archs if a in _ARCHITECTURES]
    if archs and not known:
        raise ValueError(
            f"{source}: architectures={archs} is not supported: the loader reads "
            f"{', '.join(sorted(_ARCHITECTURES))} (Llama / Mistral / Qwen2 / Qwen3 decoder-only models)"
        )
    family = _ARCHITECTURES[known[0]] if known else raw.get("model_type")
    if known and "model_type" in raw and raw["model_type"] != family:
        # transformers' AutoModelForCausalLM builds the class of model_type and ignores architectures; serving
        # stacks (vLLM, SGLang) build the class architectures names: the two would be different models
        raise ValueError(
            f"{source}: architectures={archs} names a {family} model but model_type={raw['model_type']!r}: "
            f"transformers builds the model of model_type (it ignores architectures), serving stacks the one of "
            f"architectures, so the checkpoint means two different models; set \"model_type\": \"{family}\" in "
            "config.json if the weights are that model's"
        )
    if family not in _MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type={raw.get('model_type')!r} is not supported: choose a config.json whose "
            f"architectures names one of {', '.join(sorted(_ARCHITECTURES))}"
        )
    return family


_KV_HEADS_DEFAULTS = {"mistral": 8, "qwen2": 32, "qwen3": 32}
"""transformers' ``num_key_value_heads`` of a config without the field (its config class's default); a Llama
config without it has as many key/value heads as attention heads, and so has a ``null`` in any family but
Mistral (whose config class refuses one)."""

_BIAS_FIELDS = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",), "qwen2": (), "mistral": ()}
"""The bias fields each family's transformers model reads (Qwen2 always has QKV biases and nothing else; Mistral
has no biases, whatever its config.json says; Qwen3 has no MLP biases)."""

_HEAD_DIM_DEFAULTS = {"qwen3": 128}
"""transformers' ``head_dim`` of a config without the field, where its config class has a default
(``Qwen3Config.head_dim = 128``); other families derive hidden / heads."""


def model_config_from_hf_dict(raw: dict, *, seq_length: Optional[int] = None, source: str = "config.json") -> ModelConfig:
    """``ModelConfig`` of a Hugging Face config dict (Llama / Mistral / Qwen2 / Qwen3), read as transformers reads it.

    Every field used is type-checked: a null, string or wrong-type value (``rms_norm_eps: null``,
    ``tie_word_embeddings: "false"``) is a ``ValueError`` naming the field and ``source``. A missing
    ``head_dim`` is transformers' default for the family (Qwen3: 128, else hidden / heads); the RoPE base
    follows :func:`hf_rope_theta`."""
    family = _family(raw, source)
    hidden = _require(raw, "hidden_size", source)
    layers = _require(raw, "num_hidden_layers", source)
    heads = _require(raw, "num_attention_heads", source)
    ffn = _require(raw, "intermediate_size", source)
    vocab = _require(raw, "vocab_size", source)
    if "num_key_value_heads" not in raw:
        kv = _KV_HEADS_DEFAULTS.get(family, heads)
    elif raw["num_key_value_heads"] is None and family == "mistral":
        raise ValueError(f"{source}: num_key_value_heads=None: give the number of key/value heads as an integer "
                         "(transformers' MistralConfig refuses a null)")
    else:
        kv = _optional_int(raw, "num_key_value_heads", source) or heads
    if heads % kv:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
                         + ("" if "num_key_value_heads" in raw else
                            f" (transformers' default for {family} when config.json has no num_key_value_heads)")
                         + ": give num_key_value_heads in config.json")
    if "head_dim" in raw and raw["head_dim"] is None and family in ("qwen2", "qwen3"):
        raise ValueError(f"{source}: head_dim=None: give the head dimension as an integer or leave the field out "
                         f"({family} models cannot be built with a null head_dim)")
    head_dim = _optional_int(raw, "head_dim", source)
    if head_dim is None and "head_dim" not in raw:
        head_dim = _HEAD_DIM_DEFAULTS.get(family)
    if head_dim is None and hidden % heads:
        raise ValueError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                         "and there is no head_dim")
    kv_channels = head_dim if head_dim is not None and head_dim * heads != hidden else None
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act={act!r} is not supported: the loader needs a gated SiLU (SwiGLU) MLP")
    read_bias = _BIAS_FIELDS[family]
    mlp_bias = hf_bool(raw, "mlp_bias", False, source) if "mlp_bias" in read_bias else False
    attn_bias = hf_bool(raw, "attention_bias", False, source) if "attention_bias" in read_bias else False
    ignored = [k for k in ("attention_bias", "mlp_bias") if k not in read_bias and raw.get(k) not in (None, False)]
    if ignored:
        logger.warning("%s: %s ignored: transformers' %s model reads no such field", source,
                       ", ".join(f"{k}={raw[k]!r}" for k in ignored), family)
    if family == "qwen2":
        qkv_bias, bias_linear = True, False
    elif mlp_bias or attn_bias:
        # Llama / Qwen3 attention_bias also puts a bias on o_proj: only expressible as biases everywhere
        if attn_bias != mlp_bias:
            raise ValueError(
                f"{source}: attention_bias={attn_bias} with mlp_bias={mlp_bias} cannot be expressed: "
                "ModelConfig has biases on all linears (add_bias_linear) or on QKV only (add_qkv_bias)"
            )
        qkv_bias, bias_linear = False, True
    else:
        qkv_bias, bias_linear = False, False
    dtype_key = "dtype" if raw.get("dtype") else "torch_dtype"  # transformers 5 reads torch_dtype only without dtype
    dtype_name = str(raw.get(dtype_key) or "bfloat16").replace("torch.", "")
    if dtype_name not in _TORCH_DTYPES:
        raise ValueError(f"{source}: {dtype_key}={dtype_name!r}: choose bfloat16, float16 or float32")
    rope_scaling_factor = hf_rope_scaling_factor(raw, source, strict=False)
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=kv if kv != heads else None,
        kv_channels=kv_channels,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=seq_length or DEFAULT_SEQ_LENGTH,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        rotary_base=int(hf_rope_theta(raw, source)),
        rope_scaling_factor=rope_scaling_factor,
        add_bias_linear=bias_linear,
        add_qkv_bias=qkv_bias,
        qk_layernorm=family == "qwen3",
        untie_embeddings_and_output_weights=not hf_bool(raw, "tie_word_embeddings", False, source),
        params_dtype=_TORCH_DTYPES[dtype_name],
        layernorm_epsilon=_positive_number(raw, "rms_norm_eps", 1e-6, source),
    )


def load_hf_config(path: Union[str, Path], *, seq_length: Optional[int] = None, strict: bool = False) -> ModelConfig:
    """Read ``path`` (a ``config.json`` or a directory holding one) into a ``ModelConfig``.

    ``strict``: read it as the trainer reads ``model.hf_path``
    (:func:`megatron_logra.convert.hf_config.model_config_from_hf_dict_strict`: sliding windows, scaled RoPE, MoE and
    other configs the trainer cannot run are refused with its ``ValueError``); ``seq_length`` replaces the
    config's sequence length either way.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"model={str(path)!r}: no such config.json (give a preset name or a path to a config.json)")
    raw = read_json_object(p, prefix=f"model={str(path)!r}: ")
    if strict:
        from megatron_logra.convert.hf_config import model_config_from_hf_dict_strict  # convert.hf_config imports this module

        return model_config_from_hf_dict_strict(raw, source=str(p), seq_length=seq_length)
    return model_config_from_hf_dict(raw, seq_length=seq_length, source=str(p))


def resolve_model(spec: Union[str, Path, ModelConfig], *, seq_length: Optional[int] = None,
                  strict: bool = False) -> ModelConfig:
    """A preset name, a path to a ``config.json`` (or its directory; ``strict``: see :func:`load_hf_config`), or
    a ``ModelConfig`` as is."""
    if isinstance(spec, ModelConfig):
        return replace(spec, seq_length=seq_length) if seq_length else spec
    text = str(spec).strip()
    if text.lower() in PRESETS:
        return get_preset(text, seq_length=seq_length)
    if text.lower().endswith((".yaml", ".yml")):
        raise ValueError(f"model={text!r} is a YAML file, not a model: give a preset ({', '.join(PRESETS)}) or a "
                         "Hugging Face config.json (or its directory); a YAML recipe's model is planned by "
                         "`megatron-logra train RECIPE.yaml` on a GPU")
    if text.endswith(".json") or "/" in text or Path(text).exists():
        return load_hf_config(text, seq_length=seq_length, strict=strict)
    raise ValueError(f"model={text!r} is neither a preset ({', '.join(PRESETS)}) nor a path to a config.json")
