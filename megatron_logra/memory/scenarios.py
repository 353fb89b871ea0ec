"""What ``megatron-logra memory`` plans: its parsed flags turned into planned scenarios.

Owns the step from an ``argparse`` namespace to :class:`~megatron_logra.memory.report.Scenario` objects
(:func:`_plans`): checking the flags against each other, resolving each ``--model`` as the trainer reads it
(:func:`resolve_planned_model`), choosing ``--tp auto`` (:func:`auto_tp`, bounded to one node by
:func:`auto_tp_for_job`), one ``PlanConfig`` per model and GPU size, and naming the flag behind a planner field in
an error (:func:`flag_message`). The parser, the output and the exit status stay in
:mod:`megatron_logra.memory.cli`, from which these names remain importable.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace
from typing import Optional

from megatron_logra.memory.units import GiB, parse_bytes


DEFAULT_AUTO_TP_GPUS = 8
"""GPUs of one node when ``--gpus-per-node`` is not given. ``--tp auto`` keeps TP within a node (Megatron-LM
practice: TP all-reduces twice per layer and needs the node's NVLink; PP and DP span nodes), so TP <= 8; without
``--gpus`` the whole TP x PP group stays in one node (TP <= 8 / PP) and the output states the GPU count the
planned layout implies."""

DEFAULT_RANK = 256
"""LoGRA sketch rank planned when ``--rank`` is not given."""


_LOGRA_ONLY = (("rank", "--rank", "the sketch rank"), ("masters", "--masters", "the target masters"),
               ("no_cache_projections", "--no-cache-projections", "the projection cache"),
               ("no_kl_control", "--no-kl-control", "the KL-scaled native step"),
               ("targets", "--targets", "the LoGRA target layers"))
"""Flags that set what only a LoGRA plan has (``args`` attribute, flag, what it sets): dense AdamW has
no sketches, target masters apart from its own, projections, KL-scaled step or target layers (it trains every
parameter alike), so its plan ignores them."""


def auto_tp(model, limit: int, gpus_per_stage: Optional[int] = None) -> int:
    """Largest TP size <= ``limit`` dividing heads, query groups and the MLP width (and, when given,
    ``gpus_per_stage``, so that the GPUs split into whole TP groups)."""
    heads = model.num_attention_heads
    g = math.gcd(heads, model.num_query_groups or heads, model.ffn_hidden_size)
    if gpus_per_stage is not None:
        g = math.gcd(g, gpus_per_stage)
    return max(d for d in range(1, max(1, limit) + 1) if g % d == 0)


def auto_tp_for_job(model, *, pp: int, gpus: Optional[int], gpus_per_node: int) -> int:
    """The TP that ``--tp auto`` plans for ``model``: the largest that shards it and keeps every TP group inside one
    node of ``gpus_per_node`` GPUs, because a TP group all-reduces activations twice per layer and needs the node's
    NVLink, while PP and DP traffic can cross nodes (Megatron-LM's layout).

    With ``gpus`` (the job's count) TP <= min(gpus / pp, gpus_per_node) and divides gpus / pp (whole TP groups per
    stage); when the job is more than one node, TP also divides ``gpus_per_node``, so that consecutive TP groups
    line up with node boundaries instead of straddling two nodes. Without ``gpus`` the whole TP x PP group stays
    in one node: TP <= gpus_per_node / pp (at least 1)."""
    if gpus is None:
        return auto_tp(model, gpus_per_node // pp)
    per_stage = gpus // pp
    whole = per_stage if gpus <= gpus_per_node else math.gcd(per_stage, gpus_per_node)
    return auto_tp(model, min(per_stage, gpus_per_node), whole)


def tp_spans_nodes(tp: int, gpus: Optional[int], gpus_per_node: int) -> bool:
    """Whether TP groups of ``tp`` GPUs cross a node boundary in a job of ``gpus`` GPUs (None: not given) on nodes of
    ``gpus_per_node``: a group larger than a node always does; in a job of more than one node, so does a ``tp``
    that does not divide the node (Megatron-LM places TP ranks consecutively, so groups then straddle nodes)."""
    if tp > gpus_per_node:
        return True
    return gpus is not None and gpus > gpus_per_node and gpus_per_node % tp != 0


def resolve_planned_model(name: str, *, seq_length: int):
    """The ``ModelConfig`` that ``--model name`` plans: a preset, or a Hugging Face ``config.json`` (or a
    directory holding one) read by the trainer's own loader for ``model.hf_path``
    (``convert.hf_config.model_config_from_hf_dict_strict``: :func:`~megatron_logra.convert.hf_checks.check_hf_config`,
    the field mapping, the HF-mapping support check), so a config ``train`` refuses is refused here with the
    same ``ValueError``. ``seq_length`` replaces the config's sequence length."""
    from megatron_logra.models.presets import resolve_model

    return resolve_model(name, seq_length=seq_length, strict=True)


_FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "gpus": "--gpus", "gpus_per_node": "--gpus-per-node",
          "rank": "--rank", "masters": "--masters",
          "micro_batch": "--micro-batch", "seq_len": "--seq-len", "recompute": "--recompute",
          "attention": "--attention", "engine_fraction": "--engine-fraction",
          "rollout_sequences": "--rollout-sequences", "logprob_chunk_tokens": "--logprob-chunk-tokens",
          "targets": "--targets", "model": "--model", "gpu_memory_bytes": "--gpu-memory",
          "overhead_bytes": "--overhead"}
"""The planner's field names (``PlanConfig``) and the flags that set them, so that an error names the flag."""

_FIELD_AT_START = re.compile(r"^(%s)(=|: )" % "|".join(sorted(_FLAGS, key=len, reverse=True)))


def flag_message(message: str) -> str:
    """``message`` of a ``ValueError`` with a leading planner field (``engine_fraction=1.5 must ...``,
    ``targets: 'x' is not ...``) headed by the flag that sets it (``--engine-fraction: engine_fraction=1.5 ...``)."""
    m = _FIELD_AT_START.match(message)
    return f"{_FLAGS[m.group(1)]}: {message}" if m else message


def _comma_list(flag: str, text: str, what: str) -> list[str]:
    """The items of ``text``, a comma list given to ``flag``; ``ValueError`` when it has none (``what`` says what
    to give) or an empty item (a stray comma would otherwise drop a value silently)."""
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise ValueError(f"{flag} {text!r}: {what}")
    if not all(items):
        raise ValueError(f"{flag} {text!r}: an empty item in the comma list (a stray comma?): {what}")
    return items


def _plans(args: argparse.Namespace):
    from megatron_logra.memory.plan_config import PlanConfig
    from megatron_logra.memory.planner import plan
    from megatron_logra.memory.report import Scenario

    for option in ("pp", "dp", "gpus", "gpus_per_node", "seq_len"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"{option}={value} must be an integer >= 1")
    if args.tp != "auto":
        try:
            tp_fixed = int(args.tp)
        except ValueError:
            raise ValueError(f"tp={args.tp!r}: give an integer >= 1 or auto") from None
        if tp_fixed < 1:
            raise ValueError(f"tp={tp_fixed} must be an integer >= 1 (or auto)")
    if args.distributed_optimizer and args.no_distributed_optimizer:
        raise ValueError("--distributed-optimizer and --no-distributed-optimizer contradict each other: give one")
    if args.freeze_native and args.optimizer == "adam" and not args.compare:
        raise ValueError("--freeze-native applies to LoGRA's non-target parameters; dense AdamW "
                         "(--optimizer adam) trains every parameter")
    given = [(flag, what) for name, flag, what in _LOGRA_ONLY if getattr(args, name) not in (None, False)]
    if given and args.optimizer == "adam" and not args.compare:
        flags = " and ".join(f"{flag} ({what})" for flag, what in given)
        verb, it = ("applies", "it") if len(given) == 1 else ("apply", "them")
        raise ValueError(f"{flags} {verb} to LoGRA only: the dense AdamW plan (--optimizer adam) would ignore {it}; "
                         f"drop {it}, or add --compare to plan LoGRA beside dense AdamW")
    rank = args.rank if args.rank is not None else DEFAULT_RANK
    masters = args.masters if args.masters is not None else "fp32"
    targets = None
    if args.targets is not None:
        targets = tuple(_comma_list("--targets", args.targets, "name at least one target layer (e.g. linear_qkv)"))
    gpus_texts = _comma_list("--gpu-memory", args.gpu_memory, "give a size such as 80GiB (comma list allowed)")
    models = _comma_list("--model", args.model, "give a preset or a config.json path (comma list allowed)")
    gpu_bytes = {t: parse_bytes(t, name="--gpu-memory", require_unit=True) for t in gpus_texts}
    for text, size in gpu_bytes.items():
        if size <= 0:
            raise ValueError(f"--gpu-memory {text}: give the memory of one GPU, more than 0 bytes (e.g. 80GiB)")
        if size < GiB:  # 80MB for 80GB, 1B: a plan against it is meaningless (a headroom of -10^13 %)
            raise ValueError(f"--gpu-memory {text} is {size} bytes, less than 1 GiB: give the memory of one GPU "
                             f"with its unit, e.g. 80GiB or 141GB (a unit typo such as MB for GB?)")
    overhead_bytes = parse_bytes(args.overhead, name="--overhead", require_unit=True)
    scenarios = []
    for name in models:
        try:
            model = resolve_planned_model(name, seq_length=args.seq_len)
        except ValueError as exc:  # a config.json's own problem names its path and field: say which flag gave it
            text = str(exc)
            if _FIELD_AT_START.match(text):
                raise
            raise ValueError(f"--model {text}" if text.startswith(name) else f"--model {name}: {text}") from exc
        if args.tp == "auto":
            tp = auto_tp_for_job(model, pp=args.pp, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
        else:
            tp = tp_fixed
        if args.gpus is not None:
            if args.gpus % (tp * args.pp):
                raise ValueError(f"gpus={args.gpus} must be a multiple of tp x pp = {tp * args.pp}")
            dp = args.gpus // (tp * args.pp)
            if args.dp is not None and args.dp != dp:
                raise ValueError(f"dp={args.dp} contradicts gpus={args.gpus} / (tp x pp = {tp * args.pp}) = {dp}")
        else:
            dp = args.dp if args.dp is not None else 1
        for gtext in gpus_texts:
            base = PlanConfig(
                tp=tp, pp=args.pp, dp=dp, optimizer=args.optimizer, rank=rank, masters=masters,
                micro_batch=args.micro_batch, seq_len=args.seq_len, recompute=args.recompute,
                gpu_memory_bytes=gpu_bytes[gtext], engine_fraction=args.engine_fraction,
                distributed_optimizer=args.distributed_optimizer, attention=args.attention,
                cache_projections=not args.no_cache_projections, logprob_chunk_tokens=args.logprob_chunk_tokens,
                reference_model=args.reference_model, overhead_bytes=overhead_bytes,
                rollout_sequences=args.rollout_sequences,
                freeze_native=args.freeze_native and args.optimizer == "logra",
                scaled_native_step=not args.no_kl_control, **({"targets": targets} if targets else {}),
            )
            logra = replace(base, optimizer="logra", freeze_native=args.freeze_native)
            configs = [replace(base, optimizer="adam", freeze_native=False), logra] if args.compare else [base]
            scenarios.append(Scenario(model_name=name, gpu_text=gtext, plans=tuple(plan(model, c) for c in configs)))
    return scenarios
