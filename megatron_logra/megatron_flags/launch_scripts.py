"""Flags of slime's launch scripts that are not in slime's ``arguments.py``: the Megatron-LM flags of the
``MODEL_ARGS`` (``scripts/models/*.sh``) and of the ``PERF_ARGS`` / ``OPTIMIZER_ARGS`` / ``MISC_ARGS`` arrays, and
a few slime flags of older or example scripts; and the one refusal a mixture-of-experts line gets
(:func:`moe_line_error`).

The tables are merged into :mod:`~megatron_logra.megatron_flags.unmapped`'s. Plain tables, importing nothing of
this project.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["SCRIPT_IGNORED_SWITCHES", "SCRIPT_IGNORED_VALUE_FLAGS", "SCRIPT_NEUTRAL_FLAGS", "SCRIPT_REFUSED_SWITCHES",
           "SCRIPT_REFUSED_VALUE_FLAGS", "MOE", "moe_line_error"]

MOE = "mixture-of-experts models are not supported (dense GPT only)"
_MLA = ("multi-latent attention (DeepSeek-V2 / V3, Kimi K2, Moonlight) is not supported: attention is multi-head or "
        "grouped-query here (model.num_query_groups)")
_GPUS = ("the trainer's GPUs are torchrun's (--nnodes × --nproc-per-node) and the rollout engine shares them "
         "(colocated)")

SCRIPT_IGNORED_SWITCHES: dict[str, str] = {
    "optimizer-cpu-offload": (
        "the optimizer states stay on the GPU here (there is no CPU-offloaded optimizer; LoGRA's states are a few "
        "percent of dense Adam's, and `megatron-logra memory RECIPE` says whether a run fits)"),
    "overlap-cpu-optimizer-d2h-h2d": (
        "it only overlaps the host copies of --optimizer-cpu-offload, which are not made here"),
    "use-precision-aware-optimizer": (
        "the optimizer keeps fp32 master weights and fp32 moments here (optimizer.logra.masters=fp32), which is "
        "what Megatron-LM's precision-aware optimizer keeps at its default --main-params-dtype / --exp-avg-dtype / "
        "--exp-avg-sq-dtype fp32"),
    "use-slime-router": (
        "rollout requests go to the in-process SGLang engine(s) here, with no router in between"),
}
"""Switches of slime's launch scripts accepted and ignored, each with why (logged as a warning)."""

SCRIPT_IGNORED_VALUE_FLAGS: dict[str, str] = {
    "rotary-scaling-factor": (
        "Megatron-LM reads it only for YaRN RoPE (multi-latent attention models), not for a dense model's RoPE; "
        "Llama 3.x's RoPE scaling is --use-rope-scaling / --rope-scaling-factor F (model.rope_scaling_factor), "
        "or model.hf_path's config.json"),
    "rollout-num-gpus-per-node": _GPUS,
}
"""Value flags of slime's launch scripts accepted (with their value) and ignored, each with why."""

SCRIPT_NEUTRAL_FLAGS: dict[str, tuple[type, Any, str]] = {
    "tis-level": (str, "token", "the importance weight of rl.loss.kind=tis is min(π_θ / μ, rl.loss.tis_cap) per "
                                "token; sequence and geometric levels are not supported"),
}
"""Value flags of slime's launch scripts accepted (and ignored) at the one value that matches this trainer."""

SCRIPT_REFUSED_SWITCHES: dict[str, str] = {
    "rotary-interleaved": ("RoPE rotates the two halves of each head here (Llama / Qwen's layout); interleaved "
                           "RoPE (GLM-4's) is not supported"),
    "deterministic-mode": ("the training kernels are not switched to deterministic algorithms here; a run is "
                           "seeded by train.seed (--seed), and SGLang's deterministic inference is "
                           "rl.rollout.sglang_engine_args={enable_deterministic_inference: true}"),
    "multi-latent-attention": _MLA,
}
"""Switches of slime's launch scripts this trainer cannot honour: refused, with what to do instead."""

SCRIPT_REFUSED_VALUE_FLAGS: dict[str, str] = {
    "spec": ("custom layer specs (slime_plugins) are not built here: the model is megatron-core's GPT layer spec "
             "(models/gpt.py) with the architecture of the model.* fields or model.hf_path's config.json"),
    **{flag: _MLA for flag in ("q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim",
                               "mscale", "mscale-all-dim")},
}
"""Value flags of slime's launch scripts this trainer cannot honour: refused, with what to use instead."""


def _is_moe(name: str) -> bool:
    return name == "num-experts" or name.startswith("moe-")


def moe_line_error(words: Sequence[str]) -> Optional[ValueError]:
    """One ``ValueError`` for a command line that describes a mixture-of-experts model (``--num-experts`` or any
    ``--moe-*`` flag, as the ``MODEL_ARGS`` of slime's Qwen3-30B-A3B, DeepSeek or GLM-4.5 scripts hold), naming
    its MoE flags; None for a dense line. The rest of such a line is not checked: no setting of it would run."""
    names = [word[2:].split("=", 1)[0] for word in words if word.startswith("--")]
    moe = list(dict.fromkeys(name for name in names if _is_moe(name)))
    if not moe:
        return None
    first = "num-experts" if "num-experts" in moe else moe[0]
    others = [f"--{name}" for name in moe if name != first]
    also = f" (and {len(others)} more MoE flags: {', '.join(others)})" if others else ""
    return ValueError(f"--{first} is a Megatron-LM flag this trainer cannot honour: {MOE}; this command line "
                      f"describes a mixture-of-experts model{also}. This trainer trains dense decoder models "
                      f"(Llama, Qwen2 / Qwen2.5, Qwen3 dense: give model.hf_path=DIR, or a dense model's "
                      f"MODEL_ARGS without --num-experts and --moe-*)")
