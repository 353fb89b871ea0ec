"""``megatron-logra memory``: will this configuration fit? Per-rank memory, dense AdamW vs LoGRA.

    megatron-logra memory --model 27b --tp 8 --optimizer logra --rank 128 --recompute full \\
        --gpu-memory 80GiB --engine-fraction 0.3
    megatron-logra memory --model qwen2.5-7b --tp 4 --dp 2 --compare
    megatron-logra memory --model path/to/config.json --tp auto --gpus 8 --compare
    megatron-logra memory --model 27b --tp auto --gpus 16            # TP 8 within each node, DP 2 across two
    megatron-logra memory --model qwen2.5-1.5b,qwen2.5-7b,27b --tp auto --gpus 8 \\
        --gpu-memory 81559MiB,143771MiB --compare --rank 128 --recompute full \\
        --engine-fraction 0.3 --markdown                      # the node table of docs/memory.md

``--model`` takes presets (qwen2.5-1.5b, qwen2.5-7b, 27b) or paths to a Hugging Face
``config.json`` (or its directory), read and checked as ``megatron-logra train --model.hf_path`` reads it:
a config the trainer refuses (sliding-window attention, scaled RoPE, mixture of experts, ...) is refused
here with the same message; ``--gpu-memory`` sizes with a unit, like 80GiB, 141GB, 81559MiB (comma lists plan every
combination). ``--tp auto`` takes the largest TP size <= min(GPUs / PP, GPUs per node) that shards the model:
TP stays within one node (``--gpus-per-node``, default 8), as Megatron-LM lays a job out, because TP all-reduces
activations in every layer and needs the node's NVLink, while PP and DP span nodes. With ``--gpus`` TP also
divides GPUs / PP (and the node size when the job spans nodes) and DP is GPUs / (TP x PP): ``--model 27b
--tp auto --gpus 16`` plans TP 8 x DP 2 on two 8-GPU nodes. Without ``--gpus``,
``--tp auto`` keeps each TP x PP group within one 8-GPU node (TP <= 8 / PP; ``--gpus-per-node`` sets the node)
and DP is ``--dp`` (default 1); the output then starts with a line giving the GPU count this layout implies and
what was assumed (``GPUs: 16 = TP 8 x PP 1 x DP 2 (no --gpus: ...``). A fixed ``--tp`` is planned as given; when
its TP groups span nodes (``--tp 16 --gpus 16``) the output says so in a ``Note:`` line. The defaults plan what
``megatron-logra train`` runs: AdamW states whole on every DP rank (``--distributed-optimizer`` plans Megatron-LM's
sharded optimizer instead), trained non-targets whose AdamW step a KL controller scales
(``--freeze-native``: ``optimizer.native.freeze=true``; ``--no-kl-control``: ``kl.mode=none``).
Flags that set what only LoGRA has (``--rank``, ``--masters``, ``--targets``, ``--freeze-native``,
``--no-kl-control``, ``--no-cache-projections``) are refused with ``--optimizer adam`` unless ``--compare``
plans LoGRA beside it.
``--strict`` exits with status 2 if any planned configuration does not fit.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from megatron_logra.memory.scenarios import (DEFAULT_AUTO_TP_GPUS, DEFAULT_RANK, _plans, auto_tp, auto_tp_for_job,
                                             flag_message, resolve_planned_model, tp_spans_nodes)

if TYPE_CHECKING:
    from megatron_logra.memory.report import Scenario

logger = logging.getLogger(__name__)

# auto_tp, resolve_planned_model, flag_message and the defaults live in memory.scenarios (re-exported here)
__all__ = ["main", "build_parser", "auto_tp", "auto_tp_for_job", "resolve_planned_model", "DEFAULT_AUTO_TP_GPUS",
           "DEFAULT_RANK", "assumed_gpus_note", "tp_nodes_note", "flag_message"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-logra memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset(s) or config.json path(s), comma-separated")
    p.add_argument("--tp", default="1",
                   help="tensor-parallel size, or auto: the largest that shards the model with TP <= min(--gpus / PP, "
                        "--gpus-per-node) and dividing --gpus / PP; without --gpus, TP <= --gpus-per-node / PP "
                        "(default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default 1, or GPUs / (TP x PP) with --gpus)")
    p.add_argument("--gpus", type=int, default=None,
                   help=f"GPUs in the job (sets DP; bounds --tp auto). Not given: --tp auto keeps TP x PP within "
                        f"one {DEFAULT_AUTO_TP_GPUS}-GPU node (--gpus-per-node; TP <= {DEFAULT_AUTO_TP_GPUS} / PP), "
                        f"DP is --dp, and the output states the GPU count, TP x PP x DP, this implies")
    p.add_argument("--gpus-per-node", type=int, default=DEFAULT_AUTO_TP_GPUS,
                   help=f"GPUs of one node (default {DEFAULT_AUTO_TP_GPUS}). TP stays within a node, as Megatron-LM "
                        "runs it (its all-reduces need NVLink); PP and DP span nodes: --tp auto takes TP <= this, "
                        "and a fixed --tp whose groups span nodes is planned with a note saying so")
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
                        "linear_proj, linear_fc1, linear_fc2; HF aliases and output_layer are accepted); LoGRA "
                        "only: refused with --optimizer adam unless --compare")
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


def assumed_gpus_note(args: argparse.Namespace, scenarios: Sequence[Scenario]) -> Optional[str]:
    """The line the output starts with when ``--tp auto`` runs without ``--gpus``; None otherwise.

    It gives the GPUs the planned layout occupies, TP x PP x DP of ``scenarios`` (per model when their layouts
    differ), and what was assumed: TP at most ``--gpus-per-node`` / PP (one node per TP x PP group; default
    :data:`DEFAULT_AUTO_TP_GPUS`), DP from ``--dp`` or its default 1. ``--gpus`` plans a given count instead."""
    if args.tp != "auto" or args.gpus is not None:
        return None
    layouts: dict[str, tuple[int, int, int]] = {}
    for sc in scenarios:
        c = sc.plans[0].config
        layouts.setdefault(sc.model_name, (c.tp, c.pp, c.dp))
    if len(set(layouts.values())) == 1:
        tp, pp, dp = next(iter(layouts.values()))
        gpus = f"{tp * pp * dp} = TP {tp} x PP {pp} x DP {dp}"
    else:
        gpus = ", ".join(f"{tp * pp * dp} for {name} (TP {tp} x PP {pp} x DP {dp})"
                         for name, (tp, pp, dp) in layouts.items())
    n = args.gpus_per_node
    dp_source = f"DP {args.dp} from --dp" if args.dp is not None else "DP 1 (default; set --dp)"
    return (f"GPUs: {gpus} (no --gpus: {n}-GPU nodes assumed, --tp auto took the largest TP <= {n} / PP = "
            f"{max(1, n // args.pp)} that shards the model; {dp_source}; set --gpus to plan a given count)")


def tp_nodes_note(args: argparse.Namespace, scenarios: Sequence[Scenario]) -> Optional[str]:
    """The ``Note:`` line the output carries when a planned TP group spans nodes of ``--gpus-per-node`` GPUs
    (:func:`~megatron_logra.memory.scenarios.tp_spans_nodes`); None otherwise.

    Only a fixed ``--tp`` can do so (``--tp auto`` stays within a node). The plan is still made, since the memory
    per GPU does not depend on where the GPUs are, but such a layout puts TP's per-layer all-reduces on the
    inter-node network, which Megatron-LM avoids; the note says so and what keeps TP inside a node."""
    node = args.gpus_per_node
    spanning = sorted({sc.plans[0].config.tp for sc in scenarios
                       if tp_spans_nodes(sc.plans[0].config.tp, args.gpus, node)})
    if not spanning:
        return None
    tp = spanning[-1]
    how = (f"a TP group of {tp} GPUs is larger than one node of {node}" if tp > node else
           f"TP {tp} does not divide the {node} GPUs of a node, so with --gpus {args.gpus} some TP groups "
           f"straddle two nodes")
    return (f"Note: TP {tp} spans nodes (--gpus-per-node {node}): {how}; the TP all-reduces of every layer would "
            f"cross the inter-node network instead of NVLink. Megatron-LM keeps TP within a node and spans nodes "
            f"with PP and DP: choose a --tp that divides {node} (--tp auto does), or set --gpus-per-node to your "
            f"nodes' size.")


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

    notes = [n for n in (assumed_gpus_note(args, scenarios), tp_nodes_note(args, scenarios)) if n]
    if args.markdown:
        out = [line for n in notes for line in (n, "")]  # a paragraph each
        if len(scenarios) > 1:
            out += [markdown(*summary_rows(scenarios)), ""]
        for sc in scenarios:
            out += [f"**{sc.model_name} on {sc.gpu_text}** ({layout_text(sc.plans[0])})", "",
                    markdown(*breakdown_rows(sc.plans)), ""]
        sys.stdout.write("\n".join(out) + "\n")
    else:
        from rich.console import Console

        console = Console(width=max(100, Console().width))
        for note in notes:
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
