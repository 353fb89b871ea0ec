"""TransformerEngine (TE) path of the GPT builder: availability, ``model.transformer_impl``, layer spec.

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

``model.fp8`` / ``model.fp8_recipe`` (the FP8 settings, the shapes FP8 GEMMs need, and the 16-bit probe
forwards) are :mod:`megatron_logra.models.fp8`, re-exported here.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Optional

import torch

from megatron_logra.models.fp8 import (
    FP8_FORMATS,
    FP8_MIN_CAPABILITY,
    FP8_RECIPES,
    fp8_config_kwargs,
    fp8_device_problem,
    fp8_token_multiple,
    fp8_weight_shape_problems,
    sequence_multiple,
    without_fp8,
)

logger = logging.getLogger(__name__)

__all__ = ["TRANSFORMER_IMPLS", "FP8_FORMATS", "FP8_RECIPES", "te_installed", "te_unavailable_reason",
           "check_model_fields", "fp8_token_multiple", "fp8_weight_shape_problems", "sequence_multiple",
           "resolve_transformer_impl", "te_import_problem", "layer_spec", "fp8_config_kwargs", "fp8_device_problem",
           "without_fp8", "FP8_MIN_CAPABILITY"]

TRANSFORMER_IMPLS = ("local", "transformer_engine", "auto")


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


