"""The SGLang engine's start settings as pure functions: the model's ``config.json``, the context length, the
static memory fraction and the weight payloads' serialization.

:func:`engine_hf_config` is the ``config.json`` the engine loads with ``load_format="dummy"`` (the trainer's exact
shapes and compute dtype; the weights arrive with the first full refit), with ``max_position_embeddings`` =
:func:`engine_context_length`; :func:`sglang_mem_fraction` converts a share of the whole GPU into SGLang's
``mem_fraction_static``; :func:`resolve_serialization` picks the refit payloads' serialization. Imports no SGLang
(nor megatron: the HF config helpers are imported when called).
"""

from __future__ import annotations

from typing import Any

__all__ = ["engine_context_length", "engine_hf_config", "resolve_serialization", "sglang_mem_fraction"]

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def resolve_serialization(choice: str, url: str, cuda_available: bool) -> str:
    """The payload serialization for a server at ``url``: ``choice`` unless it is ``auto``, which is ``pickle``
    (bytes by value) for every server, loopback ones included.

    ``cuda_ipc`` hands the server handles to memory on the trainer's GPU: each of its schedulers must see that
    GPU (SGLang's patched reductions map the handle's device UUID to one of *its* visible devices and raise
    for any other) and opens a CUDA context there. A server on GPUs of its own, started under a
    ``CUDA_VISIBLE_DEVICES`` that leaves out the trainer's (as docs/gpu.md starts one), sees none of them, and
    neither the URL nor the server's arguments tell the two cases apart; so ``cuda_ipc`` is only ever what
    ``rl.rollout.sglang_serialization=cuda_ipc`` asks for. ``url`` and ``cuda_available`` do not change
    ``auto``'s answer (kept for the callers)."""
    del url, cuda_available
    return "pickle" if choice == "auto" else choice


def sglang_mem_fraction(share: float, free_bytes: int, total_bytes: int, cap: float = 0.95) -> float:
    """SGLang's ``mem_fraction_static`` giving the engine ``share`` of the whole GPU (weights + KV cache).

    SGLang's fraction is of the memory free when it starts (``ModelRunner``: KV cache =
    ``free_after_weights - pre_model_load_free * (1 - mem_fraction_static)``), so this is
    ``share * total / free``, capped at ``cap``. ValueError when less than ``share`` is free.
    """
    if total_bytes <= 0 or not 0 < share < 1:
        raise ValueError(f"share={share} must lie in (0, 1) and total_bytes={total_bytes} be > 0")
    free = max(0, min(free_bytes, total_bytes)) / total_bytes
    if share > free:
        raise ValueError(f"rl.rollout.mem_fraction_static={share} but only {free:.2f} of the GPU is free "
                         "when the SGLang engine starts")
    return min(cap, share / free)


def engine_context_length(model_cfg: Any) -> int:
    """SGLang's ``context_length`` (and the config's ``max_position_embeddings``): ``seq_length`` plus a little
    headroom. A rollout holds at most ``seq_length + 1`` tokens (``rl.prompts._prompt_ids`` enforces it), and
    SGLang rejects requests whose prompt plus ``max_new_tokens`` reach its context length; rope positions
    past ``seq_length`` are never used by the trainer, so the headroom changes nothing it computes."""
    return int(model_cfg.seq_length) + 8


def engine_hf_config(model_cfg: Any, tp: int = 1) -> dict:
    """``config.json`` of the engine's model: :func:`hf_config_from_model_config` (padded vocab, the
    trainer's exact shapes) plus the fields SGLang reads to pick and build the model class
    (``architectures``, a top-level ``rope_theta``, ``torch_dtype`` = ``model.params_dtype``: the
    engine holds the trainer's compute dtype, so sketch-delta merges stay bitwise equal). SGLang loads it with
    ``load_format="dummy"``; the real weights arrive with the first full refit."""
    from megatron_logra.models.hf import hf_config_from_model_config, hf_rope_parameters

    hf = hf_config_from_model_config(model_cfg, tp)
    cfg = hf.to_dict()
    cfg["architectures"] = [_ARCHITECTURES[hf.model_type]]
    cfg["rope_theta"] = float(model_cfg.rotary_base)
    rope = hf_rope_parameters(model_cfg)  # SGLang reads a scaled RoPE from rope_scaling
    cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    cfg["torch_dtype"] = str(model_cfg.params_dtype)
    cfg["max_position_embeddings"] = engine_context_length(model_cfg)
    return cfg
