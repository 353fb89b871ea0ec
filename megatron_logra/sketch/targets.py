"""The target linears of sketch capture: :class:`SketchTarget`, and finding them in a model by name.

A requested target name selects modules by leaf name or by Megatron kind (``TARGET_ALIASES``), and every check
that could refuse a target runs here, before anything is frozen or hooked, agreed over the pipeline stages so
that every rank raises the same error or none (a stage that raised alone would leave the others waiting in the
first collective).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.parallel import all_gather_bytes, group_size
from megatron_logra.sketch.layers import LinearInfo, classify_linear
from megatron_logra.sketch.naming import TARGET_ALIASES, canonical_name

__all__ = ["SketchTarget", "find_targets"]


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


def find_targets(chunks: Sequence[nn.Module], requested: list[str], rank: int,
                 tp_group: Optional[dist.ProcessGroup], pp_group: Optional[dist.ProcessGroup]) -> list[SketchTarget]:
    """The target linears of ``chunks`` (this rank's modules, pipeline chunks) that the target names
    ``requested`` select (:func:`_matches`), each with its canonical name and state key; changes nothing.

    The checks (a weight of its own, a supported type, ``rank <= n_in``, distinct keys, every requested
    name matching a module of some stage) are agreed over ``pp_group`` in one exchange of hit counts and
    errors, so every rank of the group raises the same ``ValueError`` or none; every rank must call.
    """
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
    return found
