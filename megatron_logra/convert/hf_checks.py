"""Strict checks of a Hugging Face ``config.json``: only models megatron-core's GPT reproduces pass.

:func:`check_hf_config` accepts a ``config.json`` of a dense Llama / Mistral / Qwen2 / Qwen3
causal LM whose forward pass megatron-core's GPT reproduces, and rejects everything else with
a ``ValueError`` naming the field: other architectures, rope scaling other than Llama 3's (``rope_type:
llama3`` with megatron-core's constants, ``model.rope_scaling_factor``), partial rotary, sliding-window attention (decided per family
as transformers decides it, see :func:`check_hf_config`), mixture-of-experts fields,
quantized checkpoints, non-SiLU MLPs, and values of the wrong type (null, a string for a number or
boolean). A ``head_dim`` other than hidden/heads is supported (``model.kv_channels``); the RoPE base is
the one transformers uses (``rope_parameters.rope_theta`` before a top-level ``rope_theta``).

Every refusal is a ``ValueError`` naming the source file and the field, so a run or a conversion stops
before anything is built or written.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from megatron_logra.models.presets import _family, _require, hf_bool, hf_rope_scaling_factor, hf_rope_theta

logger = logging.getLogger(__name__)

__all__ = ["check_hf_config"]

_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")


def check_hf_config(raw: dict, source: str = "config.json", seq_length: Optional[int] = None, *,
                    seq_field: str = "model.seq_length") -> None:
    """Reject HF config fields whose model the megatron GPT would not reproduce (``ValueError`` naming the field).

    The architecture is checked first, so an unsupported family (Gemma, say) is named as such rather
    than by one of its fields. Sliding-window attention is refused exactly when transformers would run
    some layer with a window that a sequence of ``seq_length`` tokens (the run's ``model.seq_length``;
    None: unknown) can exceed (:func:`_check_full_attention`); ``seq_field`` names where ``seq_length`` came
    from in that message (``max_position_embeddings`` for a conversion, which has no run)."""
    family = _family(raw, source)
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"{source}: {key}={rope!r} is not supported (expected an object)")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"{source}: {key}.rope_type={kind!r} is not supported: the megatron model implements "
                             "unscaled (default) and Llama 3 (llama3) RoPE")
        factor = rope.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            raise ValueError(f"{source}: {key}.partial_rotary_factor={factor} is not supported (rotary on all dims only)")
    if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={raw['partial_rotary_factor']} is not supported")
    hf_rope_scaling_factor(raw, source)  # llama3: exactly the constants megatron implements
    theta = hf_rope_theta(raw, source, warn=False)  # transformers' choice between rope_parameters and rope_theta
    if theta != int(theta):
        raise ValueError(f"{source}: RoPE theta {theta!r} is not supported (model.rotary_base is a positive integer)")
    _check_full_attention(raw, family, source, seq_length, seq_field)
    for key in _MOE_FIELDS:
        if raw.get(key):
            raise ValueError(f"{source}: {key}={raw[key]} (mixture of experts) is not supported: dense models only")
    if raw.get("quantization_config"):
        raise ValueError(f"{source}: quantization_config is set: quantized checkpoints are not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key):
            raise ValueError(f"{source}: {key}={raw[key]} is not supported")


_HF_SLIDING_WINDOW_DEFAULT = 4096
"""``sliding_window`` of ``MistralConfig`` / ``Qwen2Config`` / ``Qwen3Config`` when the key is missing."""
_HF_MAX_WINDOW_LAYERS_DEFAULT = 28
"""``max_window_layers`` of ``Qwen2Config`` / ``Qwen3Config`` when the key is missing."""


def _within_window(window: Any, seq_length: Optional[int]) -> bool:
    """Whether a ``window``-token sliding window masks nothing in sequences of at most ``seq_length`` tokens
    (transformers lets query ``i`` see key ``j`` when ``i - j < window``; the largest distance is
    ``seq_length - 1``), so the model equals its full-attention self there."""
    return (seq_length is not None and isinstance(window, int) and not isinstance(window, bool)
            and 0 < seq_length <= window)


def _check_full_attention(raw: dict, family: str, source: str, seq_length: Optional[int] = None,
                          seq_field: str = "model.seq_length") -> None:
    """``ValueError`` unless transformers runs every layer of this config with full (unwindowed) attention, or
    with a window no sequence of ``seq_length`` tokens (the run's ``model.seq_length``) exceeds: then the
    windowed and the full model are the same function, and the config is accepted with an info line (the
    rollout engine, SGLang included, and an export keep the config's window).

    Decided per family as transformers 5 does (``configuration_*.py`` / ``modeling_*.py``):

    - ``mistral``: ``MistralConfig`` has no ``use_sliding_window`` switch and its ``sliding_window``
      defaults to 4096 when the key is missing; ``MistralForCausalLM`` applies it to every layer. Only
      an explicit ``"sliding_window": null`` is full attention.
    - ``qwen2`` / ``qwen3``: ``sliding_window`` counts only with ``use_sliding_window: true`` (default
      false), and then only for the layers ``i >= max_window_layers`` (default 28) unless ``layer_types``
      lists the layers explicitly; ``max_window_layers >= num_hidden_layers`` is full attention.
    - ``llama``: the model has no sliding-window attention; stray ``sliding_window`` /
      ``use_sliding_window`` / ``max_window_layers`` keys are ignored, as transformers ignores them
      (logged as a warning).

    For every family ``use_sliding_window`` must be a JSON boolean when present, and an explicit
    ``layer_types`` naming anything but ``full_attention`` is refused.
    """
    use = hf_bool(raw, "use_sliding_window", False, source)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ValueError(f"{source}: layer_types={layer_types!r} must be a list of layer types")
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise ValueError(f"{source}: layer_types contains {other}; only full_attention layers are supported")
    if family == "llama":
        stray = [f"{k}={raw[k]!r}" for k in ("sliding_window", "use_sliding_window", "max_window_layers")
                 if raw.get(k) not in (None, False)]
        if stray:
            logger.warning("%s: %s ignored: a Llama model has no sliding-window attention (transformers' "
                           "LlamaForCausalLM ignores these keys too); every layer uses full attention",
                           source, ", ".join(stray))
        return
    if family == "mistral":
        window = raw.get("sliding_window", _HF_SLIDING_WINDOW_DEFAULT)
        if _within_window(window, seq_length):
            logger.info("%s: sliding_window=%d >= model.seq_length=%d: no sequence reaches past the window, so full "
                        "attention computes the same model", source, window, seq_length)
            return
        if window is not None:
            missing = " (the key is missing: MistralConfig's default)" if "sliding_window" not in raw else ""
            ignored = (", whatever use_sliding_window says (MistralConfig has no such switch)"
                       if "use_sliding_window" in raw else "")
            raise ValueError(f"{source}: sliding_window={window}{missing} is not supported (full attention only): "
                             f"transformers' MistralForCausalLM applies it to every layer{ignored}; a Mistral "
                             'config with "sliding_window": null (full attention) is loaded, and so is this one '
                             f"for a run whose model.seq_length is at most {window} (no sequence reaches past "
                             f"the window){_seq_note(seq_length, seq_field)}")
        return
    # qwen2 / qwen3
    window = raw.get("sliding_window", _HF_SLIDING_WINDOW_DEFAULT)
    if not use or window is None or layer_types is not None:
        return
    first = raw.get("max_window_layers", _HF_MAX_WINDOW_LAYERS_DEFAULT)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"{source}: max_window_layers={first!r} must be a non-negative integer")
    layers = _require(raw, "num_hidden_layers", source)
    if first < layers and _within_window(window, seq_length):
        logger.info("%s: sliding_window=%d of layers %d..%d >= model.seq_length=%d: no sequence reaches past the "
                    "window, so full attention computes the same model", source, window, first, layers - 1, seq_length)
    elif first < layers:
        raise ValueError(f"{source}: use_sliding_window=True with sliding_window={window} and "
                         f"max_window_layers={first} gives layers {first}..{layers - 1} a sliding window, which is not supported (full "
                         f"attention only; max_window_layers >= num_hidden_layers={layers} or "
                         f"use_sliding_window=false would be full attention, and a run whose model.seq_length is at "
                         f"most {window} computes the same model{_seq_note(seq_length, seq_field)})")


def _seq_note(seq_length: Optional[int], seq_field: str = "model.seq_length") -> str:
    if seq_length is None:
        return ""
    if seq_field == "model.seq_length":
        return f"; this one has model.seq_length={seq_length}"
    return (f"; without a run it is read at its {seq_field}={seq_length}: train from the directory itself "
            "(--model.hf_path DIR) with such a model.seq_length instead")
