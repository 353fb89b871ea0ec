"""Sketch capture: ``S += Hᵀ (X Aᵀ)`` during backward, with no dense weight gradient.

``install_sketches`` freezes every target weight (so neither ``.grad`` nor a wgrad GEMM
exists: megatron-core switches to ``linear_with_frozen_weight``), and registers a forward
hook that computes ``P = X Aᵀ`` under ``no_grad`` and routes the layer output through an
identity autograd function holding ``P``. Its backward adds ``Hᵀ P`` to the target's row
block of one flat fp32 buffer and passes ``H`` through unchanged, so input gradients are
exactly those of dense training.

Activation recompute: the hook only captures when grad mode is on. Megatron's full
recompute (reentrant) runs the first forward under ``no_grad`` and captures in the
recompute; ``torch.utils.checkpoint`` (non-reentrant) captures in the first forward and
its recompute only refills the saved ``P``. Either way ``Hᵀ P`` is added once.

Tensor parallelism: a column-parallel layer owns rows and the full ``A``; a row-parallel
layer owns a column block of the input and computes a *partial* sketch with
``A[:, cols]``; ``SketchSet.reduce_tensor_parallel`` sums the partial blocks over the TP
group. Sequence parallelism moves only ``P`` (gathered or reduce-scattered along the
sequence), never ``X``; TransformerEngine linears (including the fused
``TELayerNormColumnParallelLinear``, whose captured input is the normalised hidden state)
are supported: see :mod:`megatron_logra.sketch.layers`.

Modules: :mod:`~megatron_logra.sketch.targets` (:class:`SketchTarget`, finding and checking the targets),
:mod:`~megatron_logra.sketch.sketch_set` (:class:`SketchSet`: the buffer, projections and hook), and this one
(:func:`install_sketches`: freezing, hooking).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.sketch.random_projection import DISTRIBUTIONS
from megatron_logra.sketch.sketch_set import SketchSet
from megatron_logra.sketch.targets import find_targets

logger = logging.getLogger(__name__)

__all__ = ["install_sketches", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


_EMBEDDING_TYPES = ("Embedding", "VocabParallelEmbedding", "LanguageModelEmbedding")


def _require_grad_hook(module, args, output):
    """Make the embedding output require grad so backward reaches the sketches even when every
    parameter before the first target is frozen (megatron's reentrant recompute runs the first
    forward under no_grad, so an inner anchor cannot do it)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


def install_sketches(
    model: Union[nn.Module, Sequence[nn.Module]],
    targets: Iterable[str] = DEFAULT_TARGETS,
    rank: int = 256,
    seed: int = 0,
    distribution: str = "rademacher",
    refresh: bool = True,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    pp_group: Optional[dist.ProcessGroup] = None,
    cache_projections: bool = True,
) -> SketchSet:
    """Freeze the target linears of ``model`` and capture rank-``rank`` sketches of their gradients.

    Args:
        model: a module or a list of modules (pipeline chunks).
        targets: Megatron kinds (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``),
            HF/SGLang aliases of them (``TARGET_ALIASES``: ``q_proj``/``k_proj``/``v_proj``/``qkv_proj``
            select ``linear_qkv``, the whole fused QKV weight; ``o_proj`` selects ``linear_proj``;
            ``gate_proj``/``up_proj``/``gate_up_proj`` select ``linear_fc1``, the whole fused gate+up
            weight; ``down_proj`` selects ``linear_fc2``), or exact leaf module names. A module
            matches a name when their leaf names are equal or both map to the same kind.
        rank: sketch rank ``r`` (1 <= r <= n_in of every target).
        seed: base seed of the projections.
        distribution: ``rademacher`` or ``gaussian``.
        refresh: redraw ``A`` every optimizer step (update index = step - 1) or keep index 0.
        tp_group: tensor-parallel group of megatron-core layers (None for plain modules).
        pp_group: pipeline-parallel group: ``model`` is this rank's stage. A target has to match
            a module on *some* stage (``output_layer`` lives on the last one only, the embedding
            on the first), and the checks below are agreed over the group (one exchange of hit
            counts and errors), so every rank raises the same ``ValueError`` or none. Every rank
            of the group must call. None: ``model`` is the whole model.
        cache_projections: keep each step's projections (fp32) until the step is applied,
            instead of regenerating them for every micro-batch and for the update.

    Raises:
        ValueError: unknown distribution, rank out of range, a requested target that
            matches no module (of any pipeline stage), a target of an unsupported type, or a
            target whose weight is the tied word embeddings (``output_layer`` with
            ``untie_embeddings_and_output_weights=false``). Nothing is frozen or hooked then.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution={distribution!r} is unknown; choose one of {DISTRIBUTIONS}")
    if rank < 1:
        raise ValueError(f"rank={rank} must be >= 1")
    requested = list(targets)
    if not requested:
        raise ValueError("targets is empty; name at least one target layer (e.g. linear_qkv)")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    found = find_targets(chunks, requested, rank, tp_group, pp_group)
    for t in found:
        t.weight.requires_grad_(False)
        t.weight.grad = None
    params = (p for chunk in chunks for p in chunk.parameters())
    device = next(params, torch.empty(0)).device
    sketches = SketchSet(found, rank, seed, distribution, refresh, tp_group, cache_projections, device)
    for t in found:
        sketches._handles.append(t.module.register_forward_hook(sketches._make_hook(t), with_kwargs=True))
    for chunk in chunks:
        for module in chunk.modules():
            if type(module).__name__ in _EMBEDDING_TYPES:
                sketches._handles.append(module.register_forward_hook(_require_grad_hook))
    logger.info("installed %d sketches (rank %d, %s, refresh=%s)", len(found), rank, distribution, refresh)
    return sketches
