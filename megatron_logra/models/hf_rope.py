"""The RoPE fields of a Hugging Face ``config.json``, read as transformers (>= 5) reads them.

Owns the choice of RoPE object (``rope_scaling`` or ``rope_parameters``), the RoPE base with transformers'
precedence (:func:`hf_rope_theta`) and the Llama 3 scaling factor megatron-core can build
(:func:`hf_rope_scaling_factor`, :data:`LLAMA3_ROPE_FIELDS`). Both the presets loader
(:mod:`megatron_logra.models.presets`) and the trainer's strict checks (:mod:`megatron_logra.convert.hf_checks`)
read RoPE through here, so the two agree on which field wins; the names stay importable from
:mod:`megatron_logra.models.presets`.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from megatron_logra.models.hf_fields import _positive_number

logger = logging.getLogger(__name__)


_DEFAULT_ROPE_THETA = 10000.0


LLAMA3_ROPE_FIELDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama 3 RoPE scaling constants megatron-core's ``rope_scaling`` implements (its ``factor`` is a field of
``ModelConfig``); a ``rope_type: llama3`` config with other values is refused."""


def _rope_object(raw: dict, source: str) -> tuple[str, Optional[dict]]:
    """``(key, RoPE object)`` transformers (>= 5) reads from ``raw``
    (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): ``rope_scaling`` if set, else
    ``rope_parameters`` (None when that is unset too). Not an object, or nested per layer type: a
    ``ValueError`` naming the field (not supported)."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(key)
    if rope is not None and not isinstance(rope, dict):
        raise ValueError(f"{source}: {key}={rope!r} is not supported (expected an object)")
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{source}: {key} is nested per layer type ({sorted(rope)}): not supported, give one "
                         "RoPE object for all layers")
    return key, rope


def hf_rope_scaling_factor(raw: dict, source: str, *, strict: bool = True) -> Optional[float]:
    """The Llama 3 RoPE scaling factor of ``raw`` (``model.rope_scaling_factor``), None for unscaled RoPE.

    The RoPE object is the one transformers reads (``rope_scaling`` if set, else ``rope_parameters``, as
    :func:`_rope_object`). ``rope_type: llama3`` must hold :data:`LLAMA3_ROPE_FIELDS` and a positive
    ``factor``, and no other ``rope_type`` is implemented: a ``ValueError`` naming the field when ``strict``,
    else a warning and None (the memory planner: shapes do not depend on it)."""
    key, rope = _rope_object(raw, source)
    if rope is None:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    problem = None
    if kind != "llama3":
        problem = (f"{key}.rope_type={kind!r} is not supported: the megatron model implements unscaled (default) "
                   "and Llama 3 (llama3) RoPE")
    for field, want in LLAMA3_ROPE_FIELDS.items() if problem is None else ():
        got = rope.get(field)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or got != want:
            problem = (f"{key}.{field}={got!r} is not supported: megatron-core's Llama 3 RoPE scaling is built "
                       f"with {field}={want}")
            break
    factor = rope.get("factor")
    if problem is None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                            or not math.isfinite(factor) or factor <= 0):
        problem = f"{key}.factor={factor!r} must be a positive number (Llama 3.1: 8.0)"
    if problem is None:
        return float(factor)
    if strict:
        raise ValueError(f"{source}: {problem}")
    logger.warning("%s: %s; ignored (RoPE scaling does not change shapes or memory)", source, problem)
    return None


def hf_rope_theta(raw: dict, source: str, *, warn: bool = True) -> float:
    """The RoPE base transformers (>= 5) uses for ``raw``, validated as a positive number.

    transformers' precedence (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): the RoPE dict is
    ``rope_scaling`` if set, else ``rope_parameters``; its ``rope_theta`` wins over the top-level
    ``rope_theta``, which is used only when the dict has none; 10000 when neither is given. When both are
    given and differ, the dict's value is used and (``warn``) a warning names both fields. A RoPE dict nested per
    layer type is a ``ValueError`` (not supported)."""
    key, rope = _rope_object(raw, source)
    top = _positive_number(raw, "rope_theta", _DEFAULT_ROPE_THETA, source)
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return top
    theta = _positive_number(rope, "rope_theta", top, source, label=f"{key}.")
    if warn and "rope_theta" in raw and theta != top:
        logger.warning("%s: rope_theta=%s and %s.rope_theta=%s differ: using %s.rope_theta, as transformers does",
                       source, raw["rope_theta"], key, rope["rope_theta"], key)
    return theta
