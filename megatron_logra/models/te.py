"""TransformerEngine (TE) path of the GPT builder: availability, layer spec, FP8 settings.

Nothing here imports ``transformer_engine`` at module import time, and the availability checks
use ``importlib.util.find_spec`` (no import): TE cannot be imported without CUDA, and a partial
install breaks ``import megatron.core``, so CPU environments must never load it. Only
:func:`layer_spec` with ``impl="transformer_engine"`` imports megatron's TE spec (and TE).

``model.transformer_impl``:

* ``local``: megatron-core's local spec (megatron tensor-parallel linears) with torch norms in every
  norm slot, the final one included; runs on CPU and GPU; no sequence parallelism, no FP8. megatron
  would otherwise pick apex's ``FusedLayerNorm`` for LayerNorm layers and TE's or apex's norm for the
  final one whenever those import (as on NVIDIA's images), which have no forward-mode derivative (the
  KL probe) and, for apex, no RMSNorm.
* ``transformer_engine``: ``get_gpt_layer_with_transformer_engine_spec`` (TE norms fused into
  ``linear_qkv`` / ``linear_fc1`` as ``TELayerNormColumnParallelLinear``, TE attention); needs
  CUDA and TE; enables ``model.fp8`` and ``model.sequence_parallel``.
* ``auto``: ``transformer_engine`` when TE is installed and CUDA is present, else ``local``.

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
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["TRANSFORMER_IMPLS", "FP8_FORMATS", "FP8_RECIPES", "te_installed", "te_unavailable_reason",
           "check_model_fields", "fp8_token_multiple", "fp8_weight_shape_problems", "sequence_multiple",
           "resolve_transformer_impl", "te_import_problem", "layer_spec", "fp8_config_kwargs", "fp8_device_problem",
           "without_fp8"]

TRANSFORMER_IMPLS = ("local", "transformer_engine", "auto")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
"""The lowest CUDA compute capability whose FP8 GEMMs TransformerEngine runs each recipe on: Ada (8.9) and
newer for per-tensor scaling, Hopper (9.0) for 1x128 / 128x128 block scaling, Blackwell (10.0) for MXFP8."""


def te_installed() -> bool:
    """True when a ``transformer_engine`` package is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def te_unavailable_reason() -> Optional[str]:
    """Why the TE spec cannot be built in this process, or None when it can (CUDA + TE installed)."""
    if not torch.cuda.is_available():
        return "no CUDA device is available (TransformerEngine runs on NVIDIA GPUs only)"
    if not te_installed():
        return ("transformer_engine is not installed; install the gpu extra "
                "(pip install 'megatron_logra[gpu]') or use docker/Dockerfile")
    return None


def check_model_fields(transformer_impl: str, fp8: Optional[str], fp8_recipe: str, sequence_parallel: bool) -> None:
    """Validate ``model.transformer_impl`` / ``fp8`` / ``fp8_recipe`` / ``sequence_parallel`` (``ValueError``
    naming the field). Checks that TE is installed without importing it; CUDA is checked at build time."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"model.transformer_impl={transformer_impl!r}: choose one of {', '.join(TRANSFORMER_IMPLS)}")
    if transformer_impl == "transformer_engine" and not te_installed():
        raise ValueError("model.transformer_impl='transformer_engine' but transformer_engine is not installed: "
                         "install the gpu extra on a CUDA machine (or use docker/), or set "
                         "model.transformer_impl=local or auto")
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ValueError(f"model.fp8={fp8!r}: choose null, {' or '.join(FP8_FORMATS)}")
    if fp8 is not None and transformer_impl == "local":
        raise ValueError(f"model.fp8={fp8!r} needs model.transformer_impl=transformer_engine (or auto on a "
                         "CUDA machine with TransformerEngine); the local spec has no FP8 GEMMs")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"model.fp8_recipe={fp8_recipe!r}: choose one of {', '.join(FP8_RECIPES)}")
    if sequence_parallel and transformer_impl == "local":
        raise ValueError("model.sequence_parallel=true needs model.transformer_impl=transformer_engine (or auto): "
                         "megatron-core's local torch norms do not support sequence parallelism")


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


def resolve_transformer_impl(impl: str) -> str:
    """``local`` or ``transformer_engine`` for ``model.transformer_impl=impl``.

    Raises:
        RuntimeError: ``transformer_engine`` was requested but CUDA or TE is missing.
        ValueError: an unknown value.
    """
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"model.transformer_impl={impl!r}: choose one of {', '.join(TRANSFORMER_IMPLS)}")
    reason = te_unavailable_reason()
    if impl == "auto":
        resolved = "local" if reason else "transformer_engine"
        logger.info("model.transformer_impl=auto -> %s%s", resolved, f" ({reason})" if reason else "")
        return resolved
    if impl == "transformer_engine" and reason:
        raise RuntimeError(f"model.transformer_impl='transformer_engine' cannot be built: {reason}; "
                           "or set model.transformer_impl=local (or auto)")
    return impl


MCORE_TE_IMPORT = ("transformer_engine.pytorch.fp8", ("FP8GlobalStateManager", "fp8_autocast"))
"""What megatron-core's TE wrappers (``megatron/core/extensions/transformer_engine.py``) import from TE besides
``transformer_engine`` itself; their ``HAVE_TE`` is False when it fails."""


def te_import_problem() -> Optional[str]:
    """Why megatron-core cannot build TransformerEngine layers in this process, or None when it can.

    Two flags of megatron-core must both be set: ``gpt_layer_specs.HAVE_TE`` (``import
    transformer_engine`` worked) and ``extensions.transformer_engine.HAVE_TE`` (its TE wrappers'
    imports worked, ``transformer_engine.pytorch.fp8``'s ``FP8GlobalStateManager`` and
    ``fp8_autocast`` among them). When only the second fails, megatron-core leaves its wrappers built
    on a mock, the spec still imports, and the first layer built raises "Transformer Engine is not
    installed" although it is (a TransformerEngine release that no longer provides what this
    megatron-core imports, or a TE build for another torch). Imports TE (call it only for the TE spec).
    """
    from megatron.core.extensions import transformer_engine as mcore_te
    from megatron.core.models.gpt import gpt_layer_specs

    if getattr(gpt_layer_specs, "HAVE_TE", False) and getattr(mcore_te, "HAVE_TE", False):
        return None
    module, names = MCORE_TE_IMPORT
    try:
        missing = [n for n in names if not hasattr(importlib.import_module(module), n)]
        cause = (f"{module} has no {', '.join(missing)}" if missing
                 else "megatron-core's TransformerEngine extension did not load")
    except Exception as exc:  # noqa: BLE001 - whatever the import raised is the reason to report
        cause = f"importing {module} failed ({type(exc).__name__}: {exc})"
    return (f"megatron-core {_version('megatron-core')} cannot use TransformerEngine "
            f"{_version('transformer_engine', 'transformer-engine', 'transformer_engine_torch')}: {cause}; "
            "use a TransformerEngine release that megatron-core release supports (docker/Dockerfile pairs the two)")


def _version(*dists: str) -> str:
    from importlib import metadata

    for name in dists:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "(version unknown)"


def layer_spec(impl: str, *, normalization: str, qk_layernorm: bool):
    """megatron-core ``ModuleSpec`` of one transformer layer for a resolved ``impl`` (``local``: every
    norm slot is megatron's ``WrappedTorchNorm``, which builds ``torch.nn.LayerNorm`` or
    ``torch.nn.RMSNorm`` from the ``TransformerConfig``'s ``normalization``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "transformer_engine":
        problem = te_import_problem()
        if problem:
            raise RuntimeError(f"model.transformer_impl='transformer_engine': {problem}; "
                               "or set model.transformer_impl=local")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    if impl == "local":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = WrappedTorchNorm
        if qk_layernorm:
            attention = layer.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = WrappedTorchNorm
        return spec
    raise ValueError(f"layer_spec needs a resolved impl (local or transformer_engine), got {impl!r}")


def decoder_spec(impl: str, config: Any, *, normalization: str, qk_layernorm: bool):
    """What ``GPTModel(transformer_layer_spec=...)`` takes for this rank's pipeline stage: the TE layer
    spec, or for ``local`` a ``TransformerBlockSubmodules`` of :func:`layer_spec` layers whose final norm
    is ``WrappedTorchNorm`` too (from a layer spec alone megatron picks TE's, else apex's, norm)."""
    spec = layer_spec(impl, normalization=normalization, qk_layernorm=qk_layernorm)
    if impl != "local":
        return spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=WrappedTorchNorm)


def fp8_device_problem(recipe: str, capability: tuple[int, int]) -> Optional[str]:
    """Why ``model.fp8_recipe=recipe`` cannot run on a GPU of compute capability ``capability``, or None.

    TransformerEngine accepts every recipe when the config is built and fails only in the first FP8 GEMM;
    this says so before the model is built, with the recipes the GPU does run."""
    need = FP8_MIN_CAPABILITY[recipe]
    if tuple(capability) >= need:
        return None
    runs = [r for r in FP8_RECIPES if tuple(capability) >= FP8_MIN_CAPABILITY[r]]
    fix = f"use model.fp8_recipe={' or '.join(runs)}" if runs else "set model.fp8=null"
    return (f"model.fp8_recipe={recipe} needs a GPU of compute capability {need[0]}.{need[1]} or newer, but this "
            f"one is {capability[0]}.{capability[1]}: {fix}")


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
        problem = fp8_device_problem(recipe, torch.cuda.get_device_capability())
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
