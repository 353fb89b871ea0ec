"""What the sketch-delta loader reads from and records on a live SGLang model.

Contract: the engine-side view of the model's weights, for :mod:`~megatron_logra.sync.sglang_loader`:
its TP position (:func:`engine_tp`), its weight version (:func:`engine_version`), the weights
the loader may change (all parameters but its own state parameters), and the Hugging Face
view used for fingerprints (:func:`engine_hf_view`). Reads only, apart from the attributes the
loader sets.

The engine's TP rank/size come from the ``tp_rank``/``tp_size`` attributes of SGLang's
parallel linear modules (or SGLang's parallel state, or 0/1); the weight version lives on the
model as ``model._logra_weight_version`` (0 at load). ``fingerprint`` (TP=1 engines only) hashes
the weights in Hugging Face layout (fused ``qkv_proj``/``gate_up_proj`` split back, vocab
padding rows dropped) with :func:`megatron_logra.sync.fingerprint.fingerprint`, so it compares
with the trainer's fingerprint of its HF state. Engine side: imports only torch, the standard
library and the sync package (SGLang is optional).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_logra.sync.codec import AttentionDims
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.sglang_wire import FINGERPRINT_PARAM, STATE_PARAM

__all__ = ["VERSION_ATTR", "engine_tp", "engine_version", "engine_hf_view"]

VERSION_ATTR = "_logra_weight_version"
_ATTENTION_ATTR = "_logra_attention"
_OWN_PARAMS = (STATE_PARAM, FINGERPRINT_PARAM)


def engine_tp(model: nn.Module) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this engine rank (module attributes, SGLang's state, or ``(1, 0)``)."""
    for module in model.modules():
        size, rank = getattr(module, "tp_size", None), getattr(module, "tp_rank", None)
        if isinstance(size, int) and isinstance(rank, int) and size >= 1:
            return size, rank
    try:  # pragma: no cover - only inside an SGLang worker
        from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())
    except Exception:  # sglang missing or its parallel state not initialised
        return 1, 0


def engine_version(model: nn.Module) -> int:
    """Weight version recorded on ``model`` by this loader (0 before the first delta)."""
    return int(getattr(model, VERSION_ATTR, 0))


def _own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters() if n not in _OWN_PARAMS}


def _attention_dims(model: nn.Module) -> Optional[AttentionDims]:
    dims = getattr(model, _ATTENTION_ATTR, None)
    if dims is not None:
        return dims
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionDims(heads, int(kv), int(d))


@torch.no_grad()
def engine_hf_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a TP=1 SGLang model under Hugging Face names (views, no copies).

    ``qkv_proj`` is split into ``q_proj``/``k_proj``/``v_proj`` (attention dims from the last
    delta, else ``model.config``), ``gate_up_proj`` into ``gate_proj``/``up_proj``, and the
    vocab-parallel ``embed_tokens``/``lm_head`` lose SGLang's padding rows (``org_vocab_size``).
    A tied ``lm_head`` is a shared parameter and appears once, as ``embed_tokens`` (as in the
    trainer's HF state). Raises ``SyncError("layout")`` when a fused weight does not fit.
    """
    size, _ = engine_tp(model)
    if size != 1:
        raise SyncError("layout", f"the HF view needs an unsharded engine, this one has TP={size}")
    dims = _attention_dims(model)
    out: dict[str, torch.Tensor] = {}
    for name, w in _own_weights(model).items():
        head, _, leaf = name.rpartition(".")
        if head.endswith("qkv_proj"):
            if dims is None:
                raise SyncError("layout", f"{name}: attention dims unknown (no delta yet and no model.config)")
            q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
            if w.shape[0] != q + 2 * kv:
                raise SyncError("layout", f"{name}: {w.shape[0]} rows, attention dims imply {q + 2 * kv}")
            pre = head[: -len("qkv_proj")]
            out[f"{pre}q_proj.{leaf}"], out[f"{pre}k_proj.{leaf}"], out[f"{pre}v_proj.{leaf}"] = w.split([q, kv, kv])
        elif head.endswith("gate_up_proj"):
            pre = head[: -len("gate_up_proj")]
            out[f"{pre}gate_proj.{leaf}"], out[f"{pre}up_proj.{leaf}"] = w.chunk(2, dim=0)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = getattr(model.get_submodule(head), "org_vocab_size", None)
            out[name] = w[:rows] if isinstance(rows, int) and 0 < rows <= w.shape[0] else w
        else:
            out[name] = w
    return out
