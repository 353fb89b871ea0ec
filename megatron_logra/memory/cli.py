"""``megatron-logra memory``: will this configuration fit? Per-rank memory, dense AdamW vs LoGRA.

    megatron-logra memory --model 27b --tp 8 --optimizer logra --rank 128 --recompute full \\
        --gpu-memory 80GiB --engine-fraction 0.3
    megatron-logra memory --model qwen2.5-7b --tp 4 --dp 2 --compare
    megatron-logra memory --model path/to/config.json --tp auto --gpus 8 --compare
    megatron-logra memory --model qwen2.5-1.5b,qwen2.5-7b,27b --tp auto --gpus 8 \\
        --gpu-memory 81559MiB,143771MiB --compare --rank 128 --recompute full \\
        --engine-fraction 0.3 --markdown                      # the node table of docs/memory.md

``--model`` takes presets (qwen2.5-1.5b, qwen2.5-7b, 27b) or paths to a Hugging Face
``config.json`` (or its directory), read and checked as ``megatron-logra train --model.hf_path`` reads it:
a config the trainer refuses (sliding-window attention, scaled RoPE, mixture of experts, ...) is refused
here with the same message; ``--gpu-memory`` sizes with a unit, like 80GiB, 141GB, 81559MiB (comma lists plan every
combination). ``--tp auto`` takes the largest TP size <= GPUs / PP that shards the model (with ``--gpus``,
one that also divides GPUs / PP); with ``--gpus`` the DP size is GPUs / (TP x PP). Without ``--gpus``,
``--tp auto`` assumes 8 GPUs (one 8-GPU node: TP <= 8 / PP) and DP is ``--dp`` (default 1); the output
then starts with a line saying so (``GPUs: 8 (default; set --gpus) ...``). The defaults plan what
``megatron-logra train`` runs: AdamW states whole on every DP rank (``--distributed-optimizer`` plans Megatron-LM's
sharded optimizer instead), trained non-targets whose AdamW step a KL controller scales
(``--freeze-native``: ``optimizer.native.freeze=true``; ``--no-kl-control``: ``kl.mode=none``).
Flags that set what only LoGRA has (``--rank``, ``--masters``, ``--freeze-native``, ``--no-kl-control``,
``--no-cache-projections``) are refused with ``--optimizer adam`` unless ``--compare`` plans LoGRA beside it.
``--strict`` exits with status 2 if any planned configuration does not fit.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from dataclasses import replace
from typing import Optional, Sequence

from megatron_logra.memory.units import parse_bytes

logger = logging.getLogger(__name__)

__all__ = ["main", "build_parser", "auto_tp", "resolve_planned_model", "DEFAULT_AUTO_TP_GPUS", "DEFAULT_RANK",
           "assumed_gpus_note"]

DEFAULT_AUTO_TP_GPUS = 8
"""GPUs that ``--tp auto`` assumes when ``--gpus`` is not given (one 8-GPU node); the output says so."""

DEFAULT_RANK = 256
"""LoGRA sketch rank planned when ``--rank`` is not given."""

_LOGRA_ONLY = (("rank", "--rank", "the sketch rank"), ("masters", "--masters", "the target masters"),
               ("no_cache_projections", "--no-cache-projections", "the projection cache"),
               ("no_kl_control", "--no-kl-control", "the KL-scaled native step"))
"""Flags that set what only a LoGRA plan has (``args`` attribute, flag, what it sets): dense AdamW has
no sketches, target masters apart from its own, projections or KL-scaled step, so its plan ignores them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-logra memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset(s) or config.json path(s), comma-separated")
    p.add_argument("--tp", default="1",
                   help=f"tensor-parallel size, or auto: the largest that shards the model within --gpus / PP "
                        f"({DEFAULT_AUTO_TP_GPUS} GPUs when --gpus is not given) (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default 1, or GPUs / (TP x PP) with --gpus)")
    p.add_argument("--gpus", type=int, default=None,
                   help=f"GPUs in the job (sets DP; bounds --tp auto). Not given: --tp auto assumes "
                        f"{DEFAULT_AUTO_TP_GPUS} (TP <= {DEFAULT_AUTO_TP_GPUS} / PP), DP is --dp, and the output "
                        f"says so")
    p.add_argument("--optimizer", choices=["adam", "logra"], default="logra")
    p.add_argument("--compare", action="store_true", help="plan dense AdamW and LoGRA side by side")
    p.add_argument("--rank", type=int, default=None,
                   help=f"LoGRA sketch rank (default {DEFAULT_RANK}); LoGRA only: refused with --optimizer adam "
                        "unless --compare")
    p.add_argument("--masters", choices=["fp32", "none"], default=None,
                   help="LoGRA masters (default fp32); LoGRA only: refused with --optimizer adam unless --compare")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--recompute", choices=["none", "full"], default="none")
    p.add_argument("--attention", choices=["unfused", "flash"], default="unfused",
                   help="unfused: megatron's local spec (torch norms, stores s x s scores); flash: the TransformerEngine "
                        "spec (norms fused into linear_qkv / linear_fc1, fused attention)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 141GB (comma list allowed)")
    p.add_argument("--engine-fraction", type=float, default=0.0,
                   help="GPU fraction of a colocated rollout engine (SGLang mem_fraction_static); default 0")
    p.add_argument("--rollout-sequences", type=int, default=0,
                   help="sequences an embedded rollout engine (rl.rollout.engine=embedded) generates at once on this "
                        "GPU: plans its KV cache for that many --seq-len sequences (its weights: --engine-fraction); "
                        "default 0")
    p.add_argument("--overhead", default="2GiB", help="CUDA context / NCCL / fragmentation per GPU (default 2GiB)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="plan Megatron-LM's distributed optimizer (AdamW masters and moments sharded over DP, fused "
                        "Adam); this trainer does not implement it and keeps the states whole (the default)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="keep AdamW masters and moments whole on every DP rank, as this trainer does (the default)")
    p.add_argument("--targets", default=None,
                   help="LoGRA target layers, comma-separated, as optimizer.logra.targets (default: linear_qkv, "
                        "linear_proj, linear_fc1, linear_fc2; HF aliases and output_layer are accepted)")
    p.add_argument("--freeze-native", action="store_true",
                   help="LoGRA: non-target parameters frozen (optimizer.native.freeze=true): no grads, masters "
                        "or AdamW state for them")
    p.add_argument("--no-kl-control", action="store_true",
                   help="LoGRA: the native AdamW step is not scaled by a KL controller (kl.mode=none or "
                        "logra.scale_native=false): no copy of the non-target masters during the step")
    p.add_argument("--no-cache-projections", action="store_true",
                   help="LoGRA regenerates projections (no cache from forward to apply; prepare() still holds every "
                        "target's projection while it computes the step)")
    p.add_argument("--reference-model", action="store_true",
                   help="a frozen reference model for a KL penalty (rl.loss.kl_coef > 0): its weights once more")
    p.add_argument("--logprob-chunk-tokens", type=int, default=1024,
                   help="tokens per chunk of the log-prob computation (default 1024; 0 = unchunked)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables instead of rich tables")
    p.add_argument("--strict", action="store_true", help="exit with status 2 if any configuration does not fit")
    return p


def auto_tp(model, limit: int, gpus_per_stage: Optional[int] = None) -> int:
    """Largest TP size <= ``limit`` dividing heads, query groups and the MLP width (and, when given,
    ``gpus_per_stage``, so that the GPUs split into whole TP groups)."""
    heads = model.num_attention_heads
    g = math.gcd(heads, model.num_query_groups or heads, model.ffn_hidden_size)
    if gpus_per_stage is not None:
        g = math.gcd(g, gpus_per_stage)
    return max(d for d in range(1, max(1, limit) + 1) if g % d == 0)


def resolve_planned_model(name: str, *, seq_length: int):
    """The ``ModelConfig`` that ``--model name`` plans: a preset, or a Hugging Face ``config.json`` (or a
    directory holding one) read by the trainer's own loader for ``model.hf_path``
    (``convert.hf_config.model_config_from_hf_dict_strict``: :func:`~megatron_logra.convert.hf_checks.check_hf_config`,
    the field mapping, the HF-mapping support check), so a config ``train`` refuses is refused here with the
    same ``ValueError``. ``seq_length`` replaces the config's sequence length."""
    from megatron_logra.models.presets import resolve_model

    return resolve_model(name, seq_length=seq_length, strict=True)


def assumed_gpus_note(args: argparse.Namespace) -> Optional[str]:
    """The line the output starts with when ``--tp auto`` runs without ``--gpus`` (it then assumes
    :data:`DEFAULT_AUTO_TP_GPUS` GPUs), naming the default and the flag that sets it; None otherwise."""
    if args.tp != "auto" or args.gpus is not None:
        return None
    n = DEFAULT_AUTO_TP_GPUS
    dp = f"DP {args.dp} (--dp)" if args.dp is not None else "DP 1 (default; set --dp)"
    return (f"GPUs: {n} (default; set --gpus) — --tp auto took the largest TP <= {n} / PP = {max(1, n // args.pp)} "
            f"that shards the model; {dp}")


_FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "gpus": "--gpus", "rank": "--rank", "masters": "--masters",
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


def _plans(args: argparse.Namespace):
    from megatron_logra.memory.plan_config import PlanConfig
    from megatron_logra.memory.planner import plan
    from megatron_logra.memory.report import Scenario

    for option in ("pp", "dp", "gpus", "seq_len"):
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
        targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
        if not targets:
            raise ValueError(f"--targets {args.targets!r}: name at least one target layer (e.g. linear_qkv)")
    gpus_texts = [t.strip() for t in args.gpu_memory.split(",") if t.strip()]
    if not gpus_texts:
        raise ValueError(f"--gpu-memory {args.gpu_memory!r}: give a size such as 80GiB (comma list allowed)")
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    if not models:
        raise ValueError(f"--model {args.model!r}: give a preset or a config.json path (comma list allowed)")
    gpu_bytes = {t: parse_bytes(t, name="--gpu-memory", require_unit=True) for t in gpus_texts}
    for text, size in gpu_bytes.items():
        if size <= 0:
            raise ValueError(f"--gpu-memory {text}: give the memory of one GPU, more than 0 bytes (e.g. 80GiB)")
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
            per_stage = (args.gpus if args.gpus is not None else DEFAULT_AUTO_TP_GPUS) // args.pp
            tp = auto_tp(model, per_stage, per_stage if args.gpus is not None else None)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # build-time notices about TE / FSDP
    try:
        scenarios = _plans(args)
    except ValueError as exc:
        parser.error(flag_message(str(exc)))
    from megatron_logra.memory.report import (breakdown_rows, breakdown_table, layout_text, markdown, summary_rows,
                                              summary_table, verdict_line)

    note = assumed_gpus_note(args)
    if args.markdown:
        out = [note, ""] if note else []
        if len(scenarios) > 1:
            out += [markdown(*summary_rows(scenarios)), ""]
        for sc in scenarios:
            out += [f"**{sc.model_name} on {sc.gpu_text}** ({layout_text(sc.plans[0])})", "",
                    markdown(*breakdown_rows(sc.plans)), ""]
        sys.stdout.write("\n".join(out) + "\n")
    else:
        from rich.console import Console

        console = Console(width=max(100, Console().width))
        if note:
            console.print(note, soft_wrap=True, markup=False, highlight=False)
        for sc in scenarios:
            title = f"{sc.model_name} on {sc.gpu_text} GPUs — {layout_text(sc.plans[0])}"
            console.print(breakdown_table(sc.plans, title))
            for p in sc.plans:
                colour = "green" if p.fits else "red"
                console.print(f"[{colour}]{verdict_line(p)}[/{colour}]", soft_wrap=True)
            console.print()
        if len(scenarios) > 1:
            console.print(summary_table(scenarios, "Summary (worst rank of each configuration)"))
    if args.strict and any(not p.fits for sc in scenarios for p in sc.plans):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
