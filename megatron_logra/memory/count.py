"""Exact parameter counts of one rank, from a megatron-core ``GPTModel`` built on the meta device.

The model of one pipeline stage is built at TP = 1 with the vocabulary padded for the
requested TP size (``ModelConfig.padded_vocab_size(tp)``), every tensor on ``meta`` (no
memory, no initialisation). The count of one tensor-parallel rank is then exact without
process groups: megatron marks every sharded parameter ``tensor_model_parallel`` with its
``partition_dim``, and a TP rank holds ``1/tp`` of exactly those (column-parallel QKV / fc1
weights and their biases, row-parallel proj / fc2 weights along the input, the
vocab-parallel embedding and output layer); everything else (norms, row-parallel biases)
is replicated. A dimension that ``tp`` does not divide is an error naming the field.

Pipeline stages: layers are split evenly (``num_layers % pp == 0``); the first stage holds
the word embedding, the last the final norm and the output layer (with tied embeddings and
``pp > 1`` the last stage holds its own copy of the embedding, as megatron does).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import torch
from torch.overrides import TorchFunctionMode

from megatron_logra.models.gpt import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["ParamCounts", "TargetShape", "count_params", "resolve_targets", "TARGET_KINDS", "PLANNABLE_TARGETS",
           "COLUMN_PARALLEL_TARGETS"]

TARGET_KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""LoGRA's default target linears (megatron-core names)."""
PLANNABLE_TARGETS = TARGET_KINDS + ("output_layer",)
"""Target kinds the planner models: the four layer linears and the (untied) output layer."""
COLUMN_PARALLEL_TARGETS = ("linear_qkv", "linear_fc1", "output_layer")
"""Targets whose output rows are split over TP (the others split their input columns)."""


def resolve_targets(names) -> tuple[str, ...]:
    """The target kinds (in :data:`PLANNABLE_TARGETS` order) that ``optimizer.logra.targets`` names select:
    megatron kinds, their HF / SGLang aliases (``sketch.naming.TARGET_ALIASES``: ``q_proj`` selects
    ``linear_qkv``, ...) and ``output_layer``. ``ValueError`` naming ``targets`` for an empty list or a
    name the planner cannot map to a module of megatron's GPT."""
    from megatron_logra.sketch.naming import TARGET_ALIASES

    if isinstance(names, str):
        names = [names]
    names = list(names)
    if not names:
        raise ValueError("targets is empty; name at least one target layer (e.g. linear_qkv)")
    kinds = set()
    for name in names:
        kind = "output_layer" if name == "output_layer" else TARGET_ALIASES.get(name)
        if kind is None:
            raise ValueError(f"targets: {name!r} is not a target the planner models; choose from "
                             f"{sorted(set(TARGET_ALIASES) | {'output_layer'})} (optimizer.logra.targets)")
        kinds.add(kind)
    return tuple(k for k in PLANNABLE_TARGETS if k in kinds)

_FACTORY_NAMES = frozenset({
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor", "as_tensor", "eye",
    "linspace", "empty_strided", "randperm",
})


@dataclass(frozen=True)
class TargetShape:
    """One LoGRA target kind on one rank: the local weight shape and how many layers hold it."""

    kind: str
    """megatron-core module name: linear_qkv, linear_proj, linear_fc1, linear_fc2 or output_layer."""
    n_out: int
    """Output rows held by this rank (= sketch and row-moment rows)."""
    n_in: int
    """Input columns held by this rank (= projection columns this rank applies)."""
    layers: int
    """Number of layers of this stage holding such a target."""
    low_precision: bool
    """True when the weight is 16-bit (needs an fp32 master in LoGRA's fp32-master mode)."""

    @property
    def numel(self) -> int:
        return self.n_out * self.n_in * self.layers


@dataclass(frozen=True)
class ParamCounts:
    """Parameters held by one rank (one TP rank of one pipeline stage)."""

    tp: int
    """Tensor-parallel size the counts are for."""
    pp: int
    """Pipeline-parallel size the counts are for."""
    stage: int
    """Pipeline stage (0 = first)."""
    num_layers: int
    """Transformer layers on this stage."""
    total: int
    """All parameters of this rank."""
    weight_bytes: int
    """Bytes of all parameters of this rank in their own dtypes (norms may be fp32)."""
    targets: tuple[TargetShape, ...]
    """Target linears of this rank, one entry per kind."""
    native_low_precision: int
    """Non-target parameters stored in 16 bits (embedding, output layer, biases)."""
    native_fp32: int
    """Non-target parameters stored in fp32 (megatron's local-spec norms)."""
    embedding: int
    """Word-embedding parameters on this rank (0 off the first stage, except a tied copy)."""
    output_layer: int
    """Output-layer parameters on this rank (0 when tied on a single stage)."""
    padded_vocab: int
    """Vocabulary padded for ``tp`` (all TP ranks together)."""
    largest_full_bytes: int = 0
    """Bytes of this stage's largest parameter at full (TP-unsharded) size in its dtype: what the
    streamed dense refit (``rl.weights.iter_full_params``) materialises one at a time."""
    largest_native: int = 0
    """Elements of this rank's largest non-target parameter (local shard): the largest gradient of
    LoGRA's native AdamW."""
    by_name: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """Per-parameter counts of this rank (local names), for inspection."""

    @property
    def target_params(self) -> int:
        return sum(t.numel for t in self.targets)

    @property
    def target_low_precision(self) -> int:
        return sum(t.numel for t in self.targets if t.low_precision)

    @property
    def target_rows(self) -> int:
        """Σ n_out over the target layers of this rank (rows of the flat sketch buffer)."""
        return sum(t.n_out * t.layers for t in self.targets)

    @property
    def target_cols(self) -> int:
        """Σ n_in over the target layers of this rank (columns of the cached projections)."""
        return sum(t.n_in * t.layers for t in self.targets)

    @property
    def largest_target(self) -> int:
        """Elements of the largest single target weight of this rank."""
        return max((t.n_out * t.n_in for t in self.targets), default=0)

    @property
    def largest_param(self) -> int:
        """Elements of this rank's largest parameter (local shard), target or not."""
        return max(self.largest_native, self.largest_target)

    @property
    def native(self) -> int:
        return self.native_low_precision + self.native_fp32


class _MetaFactories(TorchFunctionMode):
    """Sends tensor factories without a device (or with the CPU) to ``meta``.

    Matched by function name, so it also works when the CPU shim has replaced ``torch.empty``
    and friends by wrappers (``torch.device('meta')`` alone caches the original functions and
    would then silently allocate real CPU memory).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") in _FACTORY_NAMES:
            dev = kwargs.get("device")
            if dev is None or str(dev).startswith(("cpu", "cuda")):
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


class _SingleRankGroup:
    """Stands in for every process group of a 1-rank layout while building on meta."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    for name in ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                 "dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp"):
        setattr(pgs, name, _SingleRankGroup())
    return pgs


def _build_meta_stage(cfg: ModelConfig, tp: int, pp: int, stage: int) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_logra.models.gpt import _transformer_config
    from megatron_logra.parallel import ParallelGroups

    stage_cfg = replace(cfg, num_layers=cfg.num_layers // pp, recompute="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tcfg = _transformer_config(stage_cfg, ParallelGroups())
        spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
        with _MetaFactories():
            probe = torch.empty(1)
            if probe.device.type != "meta":  # never allocate a 27B model for real
                raise RuntimeError("meta-device build is not in effect; refusing to build the model")
            model = GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=cfg.padded_vocab_size(tp),
                max_sequence_length=cfg.seq_length,
                pre_process=stage == 0,
                post_process=stage == pp - 1,
                parallel_output=True,
                share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
                position_embedding_type=cfg.position_embedding_type,
                rotary_base=cfg.rotary_base,
                pg_collection=_pg_collection(),
            )
    if cfg.torch_dtype != torch.float32:
        # as build_gpt does for the local spec: its torch.nn.LayerNorm (built fp32) is cast to the compute dtype
        for module in model.modules():
            if type(module) is torch.nn.LayerNorm:
                module.to(cfg.torch_dtype)
    off_meta = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if off_meta:
        raise RuntimeError(f"parameters not on the meta device: {off_meta[:3]}")
    return model


def _local_numel(name: str, p: torch.Tensor, tp: int) -> int:
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return p.numel()
    dim = int(getattr(p, "partition_dim", 0))
    if p.shape[dim] % tp:
        raise ValueError(f"tp={tp} does not divide dimension {dim} ({p.shape[dim]}) of {name}: choose a tp that divides it")
    return p.numel() // tp


def _local_shape(name: str, p: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if tp > 1 and getattr(p, "tensor_model_parallel", False):
        dim = int(getattr(p, "partition_dim", 0))
        _local_numel(name, p, tp)
        shape[dim] //= tp
    return tuple(shape)


def count_params(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, stage: int = 0,
                 targets=TARGET_KINDS) -> ParamCounts:
    """Exact parameter counts of one rank of ``cfg`` at the given TP size and PP stage, with the weights
    of the target kinds ``targets`` (names as ``optimizer.logra.targets``: :func:`resolve_targets`) as
    LoGRA targets and every other parameter as a non-target."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    if pp < 1:
        raise ValueError(f"pp={pp} must be >= 1")
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must lie in [0, pp={pp})")
    if cfg.num_layers % pp:
        raise ValueError(f"pp={pp} must divide model.num_layers={cfg.num_layers} (uneven stages are not modelled)")
    kinds = resolve_targets(targets)
    key = tuple(sorted(asdict(cfg).items()))
    return _count_cached(key, tp, pp, stage, kinds)


@lru_cache(maxsize=64)
def _count_cached(key: tuple, tp: int, pp: int, stage: int, kinds: tuple[str, ...] = TARGET_KINDS) -> ParamCounts:
    cfg = ModelConfig(**dict(key))
    model = _build_meta_stage(cfg, tp, pp, stage)
    by_name: dict[str, int] = {}
    shapes: dict[str, list] = {}
    total = weight_bytes = low = fp32 = emb = out = largest_full = largest_native = 0
    for name, p in model.named_parameters():
        largest_full = max(largest_full, p.numel() * p.element_size())  # the meta model has full shapes
        n = _local_numel(name, p, tp)
        by_name[name] = n
        total += n
        weight_bytes += n * p.element_size()
        if name.startswith("embedding.word_embeddings"):
            emb += n
        elif name.startswith("output_layer"):
            out += n
        parts = name.split(".")
        kind = parts[-2] if len(parts) >= 2 else ""
        if kind in kinds and parts[-1] == "weight":
            shapes.setdefault(kind, []).append((_local_shape(name, p, tp), p.dtype != torch.float32))
            continue
        largest_native = max(largest_native, n)
        if p.dtype == torch.float32:
            fp32 += n
        else:
            low += n
    targets = []
    for kind in kinds:
        entries = shapes.get(kind, [])
        if not entries:
            continue
        distinct = {e for e in entries}
        if len(distinct) != 1:
            raise RuntimeError(f"{kind}: layers of one stage differ in shape: {sorted(distinct)}")
        (shape, lowp), = distinct
        targets.append(TargetShape(kind=kind, n_out=shape[0], n_in=shape[1], layers=len(entries), low_precision=lowp))
    del model
    counts = ParamCounts(
        tp=tp, pp=pp, stage=stage, num_layers=cfg.num_layers // pp, total=total, weight_bytes=weight_bytes,
        targets=tuple(targets), native_low_precision=low, native_fp32=fp32, embedding=emb, output_layer=out,
        padded_vocab=cfg.padded_vocab_size(tp), largest_full_bytes=largest_full, largest_native=largest_native,
        by_name=by_name,
    )
    logger.debug("counted tp=%d pp=%d stage=%d: %d params (%d in targets)", tp, pp, stage, total, counts.target_params)
    return counts
