"""Layout-independent canonical names for target layers.

The projection of a layer is keyed by its canonical name, so every runtime that holds a
piece of that layer must agree on the name: Megatron's fused ``linear_qkv`` and the
Hugging Face ``q_proj``/``k_proj``/``v_proj`` (and SGLang's ``qkv_proj``) all read the
same input and therefore share one projection.

Canonical form (SGLang/vLLM-style fused names, global layer index)::

    model.layers.{i}.self_attn.qkv_proj     <- linear_qkv | q_proj | k_proj | v_proj | qkv_proj
    model.layers.{i}.self_attn.o_proj       <- linear_proj | o_proj
    model.layers.{i}.mlp.gate_up_proj       <- linear_fc1 | gate_proj | up_proj | gate_up_proj
    model.layers.{i}.mlp.down_proj          <- linear_fc2 | down_proj

Other names inside a transformer layer keep their suffix under the canonical prefix
(``decoder.layers.4.input_layernorm`` -> ``model.layers.4.input_layernorm``); names outside
the layers (embeddings, output layer) keep their unwrapped path.
Only the standard library is imported.
"""

from __future__ import annotations

import functools
import re

__all__ = ["canonical_name", "strip_wrappers", "WRAPPER_TOKENS", "TARGET_ALIASES", "canonical_kind"]

WRAPPER_TOKENS = (
    "module",
    "_orig_mod",
    "_checkpoint_wrapped_module",
    "_fsdp_wrapped_module",
    "_forward_module",
    "base_model",
)

# target kind (user-facing Megatron name) -> canonical suffix
_KIND_SUFFIX = {
    "linear_qkv": "self_attn.qkv_proj",
    "linear_proj": "self_attn.o_proj",
    "linear_fc1": "mlp.gate_up_proj",
    "linear_fc2": "mlp.down_proj",
}

# every accepted leaf module name -> Megatron target kind
TARGET_ALIASES: dict[str, str] = {
    "linear_qkv": "linear_qkv",
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "qkv_proj": "linear_qkv",
    "linear_proj": "linear_proj",
    "o_proj": "linear_proj",
    "linear_fc1": "linear_fc1",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "gate_up_proj": "linear_fc1",
    "linear_fc2": "linear_fc2",
    "down_proj": "linear_fc2",
}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def strip_wrappers(name: str) -> str:
    """Drop wrapper path components (``module.``, ``_orig_mod.``, checkpoint/FSDP wrappers)
    and a trailing ``.weight``/``.bias``."""
    parts = [p for p in name.split(".") if p and p not in WRAPPER_TOKENS]
    if parts and parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return ".".join(parts)


def canonical_kind(leaf: str) -> str | None:
    """Megatron target kind (``linear_qkv`` ...) of a module's leaf name, or None."""
    return TARGET_ALIASES.get(leaf)


@functools.lru_cache(maxsize=8192)
def canonical_name(name: str, layer_index: int | None = None) -> str:
    """Canonical, layout-independent name of a layer.

    Args:
        name: module or parameter path in any supported layout (Megatron, HF, SGLang,
            possibly wrapped).
        layer_index: global 0-based transformer layer index. Pass it when ``name`` holds a
            pipeline-stage-local index (Megatron's ``decoder.layers.{i}`` is local to the stage).

    Idempotent: ``canonical_name(canonical_name(n)) == canonical_name(n)``. Memoised (a pure function of
    its arguments; every sync maps every engine parameter).
    """
    stripped = strip_wrappers(name)
    match = _LAYER_RE.search(stripped)
    if match is None:
        return stripped
    index = int(match.group(1)) if layer_index is None else int(layer_index)
    rest = match.group(2)
    leaf = rest.split(".")[-1]
    kind = canonical_kind(leaf)
    if kind is None:
        return f"model.layers.{index}.{rest}"
    return f"model.layers.{index}.{_KIND_SUFFIX[kind]}"
