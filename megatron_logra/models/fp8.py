"""FP8 settings of the TransformerEngine path: ``model.fp8`` / ``model.fp8_recipe``, the shapes FP8 GEMMs
accept, and the 16-bit forwards of the KL probes.

``model.fp8`` (``hybrid``: E4M3 forward, E5M2 gradients; ``e4m3``: E4M3 everywhere) maps to
megatron's ``TransformerConfig.fp8`` / ``fp8_recipe``; megatron's ``TransformerBlock`` then runs
the layers' GEMMs under TE's ``fp8_autocast``. Frozen LoGRA targets have no wgrad GEMM in any
precision; sketches are captured from the high-precision input in the forward hook. TE's per-step
FP8 weight cache is disabled (weights change in place between forwards).

TE's fused kernels have no forward-mode derivative, so the predicted-KL probe of a TE model is the
finite-difference one (``kl.probe=auto`` picks it for TE targets, :func:`megatron_logra.kl.fd_probe.predicted_kl_fd`):
three no-grad forwards with the step added to the target outputs (five with trained non-targets), in the
model's own kernels, with FP8 off (:func:`without_fp8`): a step of ``h`` relative to the weights is far below
E4M3's spacing (2^-3 relative), so through FP8 GEMMs the difference ``z(+h) - z(-h)`` would be quantisation
jumps, not the derivative; and the rollout engine samples the 16-bit policy anyway.

This module owns what FP8 asks of a run (recipes and the GPUs that run them, the ``TransformerConfig``
arguments, token and weight-shard multiples) and the context that turns it off; whether TE is available and
which layer spec is built stay with :mod:`megatron_logra.models.te`. Like it, nothing here imports
``transformer_engine`` at import time; only :func:`te_recipe_verdicts` does, when a model with FP8 is built on a
CUDA machine (asking TransformerEngine which recipes this GPU and CUDA run).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch

__all__ = ["FP8_FORMATS", "FP8_RECIPES", "FP8_MIN_CAPABILITY", "TE_RECIPE_CHECKS", "fp8_token_multiple",
           "fp8_weight_shape_problems", "sequence_multiple", "fp8_device_problem", "te_recipe_verdicts",
           "fp8_config_kwargs", "without_fp8"]

FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
"""The lowest CUDA compute capability whose FP8 GEMMs TransformerEngine runs each recipe on: Ada (8.9) and
newer for per-tensor scaling, Hopper (9.0) for 1x128 / 128x128 block scaling, Blackwell (10.0) for MXFP8."""
TE_RECIPE_CHECKS = {"delayed": "is_fp8_available", "tensorwise": "is_fp8_available",
                    "blockwise": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available"}
"""The ``FP8GlobalStateManager`` class method (``transformer_engine.pytorch.fp8``) through which TransformerEngine
says whether this GPU and CUDA run each recipe, as ``(supported, reason)``. Its conditions go beyond the
capability alone and change between releases: block scaling also needs CUDA >= 12.9 (and, in earlier
releases, a Hopper, not a Blackwell), MXFP8 is refused on 12.0+ (consumer / workstation Blackwell)."""


def fp8_token_multiple(fp8_recipe: str) -> int:
    """What each rank's token count per FP8 GEMM input must be a multiple of under ``fp8_recipe``:
    32 for ``mxfp8`` (one E8M0 scale per 32 values along the token dimension too; TE's
    ``MXFP8Quantizer`` asserts it), 16 for the per-tensor and block recipes (``assert_dim_for_fp8_exec``).
    The same figures as megatron-core's ``get_fp8_align_size``."""
    return 32 if fp8_recipe == "mxfp8" else 16


def fp8_weight_shape_problems(model: Any, tp_size: int) -> list[str]:
    """What keeps the TE linears of ``model`` (a ``ModelConfig``) at TP ``tp_size`` out of FP8 GEMMs, or ``[]``.

    TransformerEngine checks every FP8 GEMM's weight as it does its input (``assert_dim_for_fp8_exec(inputmat,
    weight)`` in ``Linear`` / ``LayerNormLinear``): each rank's ``[out, in]`` shard needs ``out % 8 == 0`` and
    ``in % 16 == 0``; with ``mxfp8`` both sides are quantised in blocks of 32 (rowwise for the forward,
    columnwise for the backward), so both must be multiples of 32. Empty without ``model.fp8``."""
    if model.fp8 is None:
        return []
    block = fp8_token_multiple(model.fp8_recipe)
    out_mult, in_mult = (block, block) if block == 32 else (8, 16)
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, (model.num_query_groups or model.num_attention_heads) * d
    fc1 = model.ffn_hidden_size * (2 if model.swiglu else 1)
    shapes = {"linear_qkv": ((q + 2 * kv) // tp_size, h), "linear_proj": (h, q // tp_size),
              "linear_fc1": (fc1 // tp_size, h), "linear_fc2": (h, model.ffn_hidden_size // tp_size)}
    return [f"{name} [{o}, {i}] per rank" for name, (o, i) in shapes.items() if o % out_mult or i % in_mult]


def sequence_multiple(fp8: Optional[str], sequence_parallel: bool, tp_size: int,
                      fp8_recipe: str = "delayed") -> int:
    """Every packed sequence length must be a multiple of this (8 without FP8 or sequence parallelism).

    With sequence parallelism each TP rank holds ``s·b/tp`` tokens of every activation, so ``s`` must
    split evenly over the TP group; TE's FP8 GEMMs check the *local* token count of each input
    (before the sequence-parallel all-gather) against :func:`fp8_token_multiple` (16, or 32 for
    ``mxfp8``). So: FP8 → ``fp8_token_multiple·tp`` with sequence parallelism, else
    ``fp8_token_multiple``; sequence parallelism alone → ``lcm(8, tp)``.
    """
    sp = tp_size if sequence_parallel and tp_size > 1 else 1
    if fp8 is not None:
        return fp8_token_multiple(fp8_recipe) * sp
    return math.lcm(8, sp)


def fp8_device_problem(recipe: str, capability: tuple[int, int],
                       te_verdicts: Optional[dict[str, tuple[bool, str]]] = None) -> Optional[str]:
    """Why ``model.fp8_recipe=recipe`` cannot run on a GPU of compute capability ``capability``, or None.

    TransformerEngine accepts every recipe when the config is built and fails only in the first FP8 GEMM;
    this says so before the model is built, with the recipes the GPU does run. ``te_verdicts``: the installed
    TransformerEngine's own ``(supported, reason)`` per recipe (:func:`te_recipe_verdicts`); a recipe it
    answers for is judged by it, one it does not by :data:`FP8_MIN_CAPABILITY`."""
    verdicts = te_verdicts or {}

    def runs(name: str) -> bool:
        if name in verdicts:
            return bool(verdicts[name][0])
        return tuple(capability) >= FP8_MIN_CAPABILITY[name]

    if runs(recipe):
        return None
    others = [r for r in FP8_RECIPES if runs(r)]
    fix = f"use model.fp8_recipe={' or '.join(others)}" if others else "set model.fp8=null"
    cc = f"{capability[0]}.{capability[1]}"
    if recipe in verdicts:
        reason = str(verdicts[recipe][1]).strip() or "no reason given"
        return f"model.fp8_recipe={recipe} cannot run on this GPU (compute capability {cc}): TransformerEngine " \
               f"says: {reason}; {fix}"
    need = FP8_MIN_CAPABILITY[recipe]
    return (f"model.fp8_recipe={recipe} needs a GPU of compute capability {need[0]}.{need[1]} or newer, but this "
            f"one is {cc}: {fix}")


def te_recipe_verdicts() -> dict[str, tuple[bool, str]]:
    """The installed TransformerEngine's ``(supported, reason)`` for each recipe on the current CUDA device
    (:data:`TE_RECIPE_CHECKS`); recipes whose check this release lacks (or that fails) are left out. Imports
    ``transformer_engine`` (call it only for the TE spec, on a CUDA machine)."""
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except Exception:  # noqa: BLE001 - no usable TE: the capability table decides
        return {}
    out: dict[str, tuple[bool, str]] = {}
    for recipe, method in TE_RECIPE_CHECKS.items():
        check = getattr(FP8GlobalStateManager, method, None)
        if check is None:
            continue
        try:
            ok, reason = check()
        except Exception:  # noqa: BLE001 - a check that cannot answer leaves the table to decide
            continue
        out[recipe] = (bool(ok), str(reason))
    return out


def fp8_config_kwargs(fp8: Optional[str], recipe: str, impl: str) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments of ``model.fp8`` / ``model.fp8_recipe`` (empty when off).

    Raises:
        RuntimeError: FP8 requested while the model is built with the local spec.
        ValueError: the current CUDA device cannot run ``recipe`` (:func:`fp8_device_problem`).
    """
    if fp8 is None:
        return {}
    if impl != "transformer_engine":
        raise RuntimeError(f"model.fp8={fp8!r} needs the TransformerEngine spec, but the model is built with "
                           f"the {impl} spec: set model.transformer_impl=transformer_engine on a CUDA machine "
                           "with TransformerEngine, or model.fp8=null")
    if torch.cuda.is_available():
        problem = fp8_device_problem(recipe, torch.cuda.get_device_capability(), te_recipe_verdicts())
        if problem:
            raise ValueError(problem)
    # TE caches each weight's FP8 copy from the first micro-batch on; LoGRA merges updates into the
    # weights in place and the RL loop runs forwards outside megatron's schedules (which are what reset
    # the cache), so the cache is off: every forward casts the current weights.
    return {"fp8": fp8, "fp8_recipe": recipe, "fp8_wgrad": True, "disable_parameter_transpose_cache": True}


@contextlib.contextmanager
def without_fp8(model: Any) -> Iterator[None]:
    """Forwards of ``model`` (a module or a list of pipeline chunks) inside run in its 16-bit precision.

    megatron decides at every forward whether to enter TE's FP8 autocast from ``config.fp8`` of the
    block (and of each layer, whose config may be its own object); this clears ``fp8`` on every distinct
    config the model's modules hold and puts each back on exit, also when the body raises. TE modules
    outside the autocast compute in their parameters' dtype. A model without FP8 is left as it is.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    configs: dict[int, Any] = {}
    for chunk in chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "fp8", None):
                configs[id(config)] = config
    saved = [(config, config.fp8) for config in configs.values()]
    for config, _ in saved:
        config.fp8 = None
    try:
        yield
    finally:
        for config, fp8 in saved:
            config.fp8 = fp8
