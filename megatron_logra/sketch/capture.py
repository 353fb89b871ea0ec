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
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.parallel import all_gather_bytes, group_size
from megatron_logra.sketch.layers import (
    LinearInfo, classify_linear, gather_sequence, normalized_input, reduce_scatter_sequence,
)
from megatron_logra.sketch.naming import TARGET_ALIASES, canonical_name
from megatron_logra.sketch.random_projection import DISTRIBUTIONS, projection

logger = logging.getLogger(__name__)

__all__ = ["SketchTarget", "SketchSet", "install_sketches", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(kw_only=True)
class SketchTarget(LinearInfo):
    """One frozen target linear layer and its sketch; how it is split comes from ``LinearInfo``."""

    name: str
    """Canonical layer name (keys the projection)."""
    module_name: str
    """Path of the module inside the model it was installed on."""
    module: nn.Module
    weight: nn.Parameter
    """The frozen weight ``[n_out_local, n_in_local]``."""
    kind: str
    """Megatron target kind: linear_qkv | linear_proj | linear_fc1 | linear_fc2 (or the leaf name)."""
    key: str = ""
    """Unique state key: the canonical name, suffixed with the leaf when several modules share
    it (HF q/k/v_proj all map to ``qkv_proj``)."""
    row_offset: int = 0
    """First row of this target in the flat sketch buffer."""
    sketch: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    """``[n_out_local, r]`` fp32 view into the flat buffer."""

    @property
    def n_out_local(self) -> int:
        return self.weight.shape[0]

    @property
    def partial(self) -> bool:
        """True when the sketch on this rank is a partial sum over the TP group (row-parallel input
        columns, or a replicated layer that sees only this rank's tokens under sequence parallelism)."""
        return self.parallel == "row" or (self.parallel == "none" and self.sequence_parallel)


class _SketchCapture(torch.autograd.Function):
    """Identity on the layer output whose backward accumulates ``Hᵀ P`` into the sketch.

    The output shares ``out``'s storage and version counter but is not an autograd view of it:
    a consumer may modify it in place, as megatron's vocab-parallel cross entropy does with the
    logits of ``output_layer`` (autograd forbids in-place changes to a custom Function's view
    output). Nothing saves ``out`` for backward, and the shared version counter still catches any
    later use of a stale value."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, proj_in: torch.Tensor, anchor: torch.Tensor, target: SketchTarget):
        ctx.save_for_backward(proj_in)
        ctx.target = target
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (proj_in,) = ctx.saved_tensors
        sketch_OR: torch.Tensor = ctx.target.sketch
        grad_TO = grad_out.reshape(-1, grad_out.shape[-1])
        proj_TR = proj_in.reshape(-1, proj_in.shape[-1])
        if grad_TO.dtype == torch.float32 and proj_TR.dtype == torch.float32:
            sketch_OR.addmm_(grad_TO.t(), proj_TR)
        else:
            sketch_OR.addmm_(grad_TO.t().float(), proj_TR.float())
        return grad_out, None, None, None


class SketchSet:
    """All sketches of a model: targets, the flat fp32 buffer, projection bookkeeping.

    ``update`` is the projection update index in use; the optimizer calls ``advance()``
    after each applied step (a no-op for the index when ``refresh`` is off).
    """

    def __init__(
        self,
        targets: list[SketchTarget],
        rank: int,
        seed: int,
        distribution: str,
        refresh: bool,
        tp_group: Optional[dist.ProcessGroup],
        cache_projections: bool,
        device: Optional[torch.device] = None,
    ) -> None:
        """``device``: where the buffer lives when ``targets`` is empty (a pipeline stage without
        targets); otherwise the targets' weights' device."""
        self.targets = targets
        self.rank = rank
        self.seed = seed
        self.distribution = distribution
        self.refresh = refresh
        self.tp_group = tp_group
        self.cache_projections = cache_projections
        self.num_updates = 0
        self.capture_enabled = True
        self._cache: dict[tuple[str, int], torch.Tensor] = {}
        self._handles: list = []
        device = targets[0].weight.device if targets else (device or torch.device("cpu"))
        num_rows = sum(t.n_out_local for t in targets)
        self.flat = torch.zeros(num_rows, rank, dtype=torch.float32, device=device)
        offset = 0
        for t in targets:
            t.row_offset = offset
            t.sketch = self.flat[offset : offset + t.n_out_local]
            offset += t.n_out_local
        # Makes every capture output require grad even when all parameters are frozen,
        # so backward reaches the sketches (DESIGN: the "embedding hook" requirement).
        self._anchor = torch.zeros(0, device=device, requires_grad=True)

    # ------------------------------------------------------------------ projections
    @property
    def update(self) -> int:
        """Projection update index of the step being accumulated."""
        return self.num_updates if self.refresh else 0

    def projection_for(self, target: SketchTarget, update: Optional[int] = None) -> torch.Tensor:
        """fp32 ``[r, len(cols)]``: the columns of ``A`` this rank applies to ``target``."""
        update = self.update if update is None else update
        key = (target.name + (f"|{target.cols.start}:{target.cols.stop}" if target.cols else ""), update)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        proj_RI = projection(
            self.seed, target.name, update, self.rank, target.n_in,
            distribution=self.distribution, cols=target.cols, device=target.weight.device,
        )
        if self.cache_projections:
            self._cache[key] = proj_RI
        return proj_RI

    def advance(self) -> None:
        """Move to the next update index and drop cached projections of the old one."""
        self.num_updates += 1
        if self.refresh:
            self._cache.clear()

    def seek(self, num_updates: int) -> None:
        """Continue after ``num_updates`` applied updates (resuming a run): drop every cached projection."""
        self.num_updates = num_updates
        self._cache.clear()

    # ------------------------------------------------------------------ buffer ops
    def zero_(self) -> None:
        self.flat.zero_()

    def reduce_tensor_parallel(self) -> None:
        """Sum the partial sketches of row-parallel targets over the TP group (one collective)."""
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return
        partial = [t for t in self.targets if t.partial]
        if not partial:
            return
        packed = torch.cat([t.sketch.reshape(-1) for t in partial])
        dist.all_reduce(packed, group=self.tp_group)
        offset = 0
        for t in partial:
            n = t.sketch.numel()
            t.sketch.copy_(packed[offset : offset + n].view_as(t.sketch))
            offset += n

    def sketches(self) -> dict[str, torch.Tensor]:
        """Target key -> sketch view (rows local to this TP rank)."""
        return {t.key: t.sketch for t in self.targets}

    @contextlib.contextmanager
    def paused(self):
        """Forward passes inside this context capture nothing (evaluation, probes)."""
        prev = self.capture_enabled
        self.capture_enabled = False
        try:
            yield
        finally:
            self.capture_enabled = prev

    def remove(self) -> None:
        """Remove the hooks (weights stay frozen)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hook
    def target_input(self, target: SketchTarget, x: torch.Tensor) -> torch.Tensor:
        """The input ``X`` the target's weight multiplies, given the module's forward input ``x``
        (``norm(x)`` for a fused TE ``LayerNormLinear``; this rank's shard under TP / SP)."""
        return normalized_input(target.module, x) if target.fused_norm else x

    @torch.no_grad()
    def project_input(self, target: SketchTarget, x: torch.Tensor) -> torch.Tensor:
        """``P = X·Aᵀ`` aligned with the output gradient this rank receives.

        Column-parallel targets under sequence parallelism all-gather ``P`` along the sequence;
        row-parallel ones reduce-scatter their partial ``P`` (in fp32) so each rank holds the
        sum over TP for its own sequence chunk."""
        x = self.target_input(target, x.detach())
        proj_in = torch.matmul(x, self.projection_for(target).to(x.dtype).t())
        if target.sequence_parallel:
            if target.parallel == "row":
                proj_in = reduce_scatter_sequence(proj_in.float(), self.tp_group)
            elif target.parallel == "column":
                proj_in = gather_sequence(proj_in, self.tp_group)
        return proj_in

    def _make_hook(self, target: SketchTarget) -> Callable:
        def hook(module, args, kwargs, output):
            if not (self.capture_enabled and torch.is_grad_enabled()):
                return None
            x = args[0] if args else next(iter(kwargs.values()))
            proj_in = self.project_input(target, x)
            if isinstance(output, tuple):
                return (_SketchCapture.apply(output[0], proj_in, self._anchor, target),) + tuple(output[1:])
            return _SketchCapture.apply(output, proj_in, self._anchor, target)

        return hook


def _global_layer_index(model: nn.Module, module_name: str) -> Optional[int]:
    """0-based global layer index from the nearest enclosing module with ``layer_number``
    (megatron's TransformerLayer numbers layers globally, from 1, across pipeline stages)."""
    parts = module_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            parent = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        number = getattr(parent, "layer_number", None)
        if isinstance(number, int):
            return number - 1
    return None


_EMBEDDING_TYPES = ("Embedding", "VocabParallelEmbedding", "LanguageModelEmbedding")


def _require_grad_hook(module, args, output):
    """Make the embedding output require grad so backward reaches the sketches even when every
    parameter before the first target is frozen (megatron's reentrant recompute runs the first
    forward under no_grad, so an inner anchor cannot do it)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


def _matches(leaf: str, requested: str) -> bool:
    """Whether a module with leaf name ``leaf`` is selected by the target name ``requested``: the same leaf
    name, or the same Megatron kind once both names go through ``TARGET_ALIASES`` (``q_proj`` selects
    megatron's fused ``linear_qkv``, ``gate_proj`` its fused ``linear_fc1``, and in a model with separate
    HF projections ``q_proj`` selects ``k_proj`` and ``v_proj`` too: they read the same input and share
    one projection)."""
    if leaf == requested:
        return True
    kind = TARGET_ALIASES.get(requested)
    return kind is not None and TARGET_ALIASES.get(leaf) == kind


def _check_own_weight(module: nn.Module, module_name: str, matched: list[str]) -> None:
    """Refuse a target without a weight of its own: megatron's ``output_layer`` with tied word
    embeddings has none at PP = 1 (``weight`` is None, the embedding's is passed in) and, at PP > 1,
    the last stage's copy of the embedding (``shared_embedding``), which must stay equal to it."""
    if not hasattr(module, "weight"):
        return  # not a linear layer: classify_linear names the type
    weight = module.weight
    if weight is None or getattr(weight, "shared_embedding", False):
        raise ValueError(
            f"target {matched[0]!r} matches {module_name}, whose weight is the word embeddings (tied embeddings: "
            f"model.untie_embeddings_and_output_weights=false); a tied output layer cannot be a LoGRA target: set "
            f"model.untie_embeddings_and_output_weights=true or drop {matched[0]!r} from the targets "
            f"(optimizer.logra.targets)"
        )


def _agree_over_pipeline(hits: dict[str, int], error: Optional[str],
                         pp_group: Optional[dist.ProcessGroup]) -> tuple[dict[str, int], Optional[str]]:
    """Target hits summed over the pipeline stages and the first stage's error (``"pipeline stage k:
    ..."``), the same on every rank of ``pp_group``; unchanged without a group of more than one rank."""
    if group_size(pp_group) == 1:
        return hits, error
    mine = json.dumps({"hits": hits, "error": error}).encode()
    total = dict.fromkeys(hits, 0)
    first_error = None
    for stage, raw in enumerate(all_gather_bytes(mine, pp_group)):
        part = json.loads(raw.decode())
        for r, n in part["hits"].items():
            total[r] += n
        if part["error"] is not None and first_error is None:
            first_error = f"pipeline stage {stage}: {part['error']}"
    return total, first_error


def _assign_keys(found: list[SketchTarget]) -> None:
    """Set each target's state key: its canonical name, plus the leaf name where several targets share
    one canonical name (HF ``q_proj``/``k_proj``/``v_proj``). Two *different* layers with the same key
    (``encoder.layers.0.mlp.down_proj`` and ``decoder.layers.0.mlp.down_proj``, or plain-module chunks
    each with a local ``layers.0``) would share one row moment, update direction and projection:
    ``ValueError`` naming both module paths."""
    counts: dict[str, int] = {}
    for t in found:
        counts[t.name] = counts.get(t.name, 0) + 1
    owner: dict[str, SketchTarget] = {}
    for t in found:
        t.key = t.name if counts[t.name] == 1 else f"{t.name}/{t.module_name.split('.')[-1]}"
        first = owner.setdefault(t.key, t)
        if first is not t:
            raise ValueError(
                f"target layers {first.module_name} and {t.module_name} both map to canonical name {t.name} "
                f"(state key {t.key!r}), so they would share one row moment, update direction and projection; "
                f"give the layers distinct global indices (a layer_number attribute on each layer, numbered "
                f"from 1 across the whole model, as megatron-core's TransformerLayer has) or target only one "
                f"of them (optimizer.logra.targets)")


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
    found: list[SketchTarget] = []
    hits = {r: 0 for r in requested}
    error, local_exc = None, None
    try:
        for chunk_idx, chunk in enumerate(chunks):
            for module_name, module in chunk.named_modules():
                leaf = module_name.split(".")[-1]
                matched = [r for r in requested if _matches(leaf, r)]
                if not matched:
                    continue
                for r in matched:
                    hits[r] += 1
                _check_own_weight(module, module_name, matched)
                info = classify_linear(module, tp_group, module_name)
                n_in = info.n_in
                if rank > n_in:
                    raise ValueError(f"rank={rank} exceeds n_in={n_in} of target {module_name}; "
                                     f"choose optimizer.logra.rank <= {n_in}")
                layer = _global_layer_index(chunk, module_name)
                name = canonical_name(module_name, layer_index=layer)
                prefix = f"{chunk_idx}." if len(chunks) > 1 else ""
                found.append(SketchTarget(
                    name=name, module_name=prefix + module_name, module=module, weight=module.weight,
                    kind=TARGET_ALIASES.get(leaf, leaf), **vars(info),
                ))
        _assign_keys(found)
    except ValueError as exc:  # raised below, once every stage has reported
        error, local_exc = str(exc), exc
    hits, error = _agree_over_pipeline(hits, error, pp_group)
    if error is not None:
        raise ValueError(error) from local_exc
    missing = [r for r, n in hits.items() if n == 0]
    if missing:
        where = " (on any pipeline stage)" if group_size(pp_group) > 1 else ""
        kinds = [f"{r} selects {TARGET_ALIASES[r]}" for r in missing if TARGET_ALIASES.get(r, r) != r]
        raise ValueError(
            f"targets {missing} match no module of the model{where}"
            + (f" ({'; '.join(kinds)})" if kinds else "")
            + f"; known target names are {sorted(set(TARGET_ALIASES))} (each alias selects its Megatron kind) "
            f"or exact leaf module names; fix or drop them in optimizer.logra.targets"
        )
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
