#!/usr/bin/env python
"""Memory stress: N real LoGRA and dense-AdamW training steps at a given scale; per-step peaks as CSV + PNG.

    python tools/memory_stress.py --hidden 2048 --layers 8 --micro-batch 2 --seq-len 2048 --steps 5
    torchrun --nproc-per-node 8 tools/memory_stress.py --model 27b --tp 8 --rank 128 --recompute full --steps 3
    python tools/memory_stress.py --model 27b --tp 8 --dry-run          # planner prediction only (meta device)
    python tools/memory_stress.py --device cpu --hidden 64 --layers 2 --rank 8 --steps 2 --out /tmp/stress

Per optimizer (``--optimizers logra,adam``, one after another in this process): build the GPT,
run ``--steps`` full steps (forward/backward of the RL loss on chunked vocabulary-parallel
log-probs, or megatron's LM loss with ``--loss lm``; ``prepare``; ``apply``) and record per step,
as the maximum over ranks:

* CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (reset every step) and, with
  nvidia-ml-py and the NVML library, the device's used memory sampled every 5 ms (whole device);
* CPU: the peak of live tensor bytes (:class:`megatron_logra.memory.measure.LiveTensorTracker`)
  and the process's peak RSS (imports included; reset through ``/proc/self/clear_refs``);
* optimizer-state bytes counted from the objects (fp32 grads, masters, Adam moments; LoGRA: sketch
  buffer, row moments, target masters and its native AdamW's state).

Beside them: the memory planner's prediction (``megatron_logra.memory``, counts from the model on
the meta device; no distributed optimizer, engine or CUDA overhead): trainer peak and optimizer
state. ``--dry-run`` builds and runs nothing: the table and the files hold the prediction only. Rank 0
writes ``OUT/memory_stress.{csv,png}`` (``--out``, default ``runs/memory_stress``).

A bad value ends with one ``error:`` line, exit status 2, before anything is built; it names this script's flags
with the values given (``--hidden=63 is not divisible by --heads=4``, not the trainer's ``model.hidden_size``;
:mod:`megatron_logra.memory.stress_flags`) and a fix these flags can make.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from optimizer_memory import ffn_size  # noqa: E402

from megatron_logra.bench.outputs import why_unwritable  # noqa: E402
from megatron_logra.cli.errors import tracebacks_wanted  # noqa: E402
from megatron_logra.memory.stress_flags import flag_error  # noqa: E402
from megatron_logra.memory.stress_setup import host_shortfall, out_of_memory, predicted  # noqa: E402
from megatron_logra.memory.stress_report import COLUMNS, MEASURED, GiB, NvmlSampler, fmt, plot, report, unit_of  # noqa: E402,F401
from megatron_logra.memory.stress_steps import run_kind  # noqa: E402

logger = logging.getLogger("memory_stress")
MODEL_SIZE_FLAGS = ("hidden", "layers", "heads", "query_groups", "ffn", "vocab", "dtype")
"""The flags that size the model built without ``--model`` (refused with it, which has sizes of its own)."""
MODEL_SIZE_DEFAULTS = {"hidden": 256, "layers": 2, "vocab": 32000, "dtype": "bfloat16"}

SIZES = "--hidden, --layers, --vocab, --micro-batch or --seq-len (or a smaller --model)"


def model_config(args):
    from megatron_logra.models.gpt import ModelConfig
    from megatron_logra.models.presets import resolve_model

    if args.model:
        return resolve_model(args.model, seq_length=args.seq_len)
    size = {f: getattr(args, f) if getattr(args, f) is not None else d for f, d in MODEL_SIZE_DEFAULTS.items()}
    hidden = size["hidden"]
    return ModelConfig(num_layers=size["layers"], hidden_size=hidden, num_attention_heads=args.heads or max(1, hidden // 64),
                       num_query_groups=args.query_groups, ffn_hidden_size=args.ffn or ffn_size(hidden),
                       vocab_size=size["vocab"], seq_length=args.seq_len, params_dtype=size["dtype"], swiglu=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memory_stress.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=None, help="preset (qwen2.5-1.5b, qwen2.5-7b, 27b) or config.json; else the sizes below")
    for flag, default, what in (
            ("--hidden", None, "hidden size (default 256)"), ("--layers", None, "layers (default 2)"),
            ("--heads", None, "attention heads (default hidden // 64)"),
            ("--query-groups", None, "query groups (default: one per head)"),
            ("--ffn", None, "MLP width (default: optimizer_memory.py's ffn_size of --hidden)"),
            ("--vocab", None, "vocabulary (default 32000)"),
            ("--micro-batch", 1, "sequences per micro-batch (default 1)"),
            ("--micro-batches", 1, "micro-batches per step (default 1)"),
            ("--seq-len", 512, "tokens per sequence (default 512)"),
            ("--tp", 1, "tensor-parallel size; the world size under torchrun must be a multiple (default 1)"),
            ("--rank", 128, "LoGRA sketch rank (default 128)"),
            ("--chunk-tokens", 1024, "tokens per log-prob chunk of the RL loss, 0 = one chunk (default 1024)"),
            ("--steps", 3, "steps per optimizer (default 3)")):
        add(flag, type=int, default=default, help=what)
    add("--dtype", default=None, choices=["bfloat16", "float32", "float16"], help="parameter dtype (default bfloat16)")
    add("--masters", choices=["fp32", "none"], default="fp32")
    add("--recompute", choices=["none", "full"], default="none")
    add("--loss", choices=["rl", "lm"], default="rl", help="RL loss (chunked log-probs) or megatron's LM loss")
    add("--optimizers", default="logra,adam", help="comma list of logra and/or adam, run in this order (default both)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto",
        help="auto: CUDA when available (default); cuda or cpu is refused when it is not the one present")
    add("--no-track-tensors", dest="track_tensors", action="store_false", help="CPU: RSS only (faster)")
    add("--dry-run", action="store_true",
        help="planner prediction only: nothing is built or run; the table and OUT/memory_stress.{csv,png} hold the "
             "prediction")
    add("--out", default="runs/memory_stress",
        help="directory of memory_stress.csv and memory_stress.png (default runs/memory_stress)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    kinds = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    if not kinds or any(k not in ("logra", "adam") for k in kinds):
        parser.error(f"--optimizers={args.optimizers!r}: give logra and/or adam, comma-separated (e.g. logra,adam)")
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    for flag in ("micro_batch", "micro_batches", "seq_len", "tp", "rank", "layers", "hidden", "vocab",
                 "heads", "query_groups", "ffn"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:  # 0 would fall back to the default
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    given = [f"--{f.replace('_', '-')}" for f in MODEL_SIZE_FLAGS if getattr(args, f) is not None]
    if args.model and given:  # the preset's / config.json's own sizes would silently win
        parser.error(f"--model {args.model} takes its sizes and dtype from the preset or config.json, so {', '.join(given)} "
                     "would be ignored: drop them, or drop --model to build a model of those sizes")
    # what the user gave: an error marks the other values it shows as the script's defaults
    typed = {f for f in MODEL_SIZE_FLAGS if getattr(args, f) is not None}
    if args.rank != parser.get_default("rank"):
        typed.add("rank")
    for flag, default in MODEL_SIZE_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    problem = why_unwritable(args.out, directory=True) if args.out.strip() else "an empty path"  # before anything runs
    if problem:
        parser.error(f"--out={args.out}: {problem}; give a directory (memory_stress.csv and .png are written there)")
    if args.chunk_tokens < 0:
        parser.error(f"--chunk-tokens={args.chunk_tokens} must be >= 0 (0 = unchunked)")
    try:
        mcfg = replace(model_config(args), recompute=args.recompute)
        for k in kinds:  # the planner's layout checks (TP divides the model, LoGRA rank <= every target's n_in)
            predicted(mcfg, k, args, args.tp)
    except ValueError as exc:  # the shared checks name config fields: say it in this script's flags
        parser.error(flag_error(str(exc), args, typed))
    title = (f"{args.model or f'hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}'}; micro-batch "
             f"{args.micro_batch} x seq {args.seq_len} x {args.micro_batches}, TP {args.tp}, LoGRA rank {args.rank} "
             f"({args.masters} masters), recompute {args.recompute}, loss {args.loss}")
    if args.dry_run:
        rows = [{"optimizer": k, "step": 0, "device": "meta", "world": args.tp, "tp": args.tp,
                 "tokens_per_step": args.micro_batch * args.seq_len * args.micro_batches,
                 **dict(zip(("predicted_peak_bytes", "predicted_optimizer_state_bytes"), predicted(mcfg, k, args, args.tp)))}
                for k in kinds]
        report(rows, Path(args.out), title + " (dry run: planner only)")
        return 0
    use_cuda = torch.cuda.is_available()
    if args.device != "auto" and use_cuda != (args.device == "cuda"):  # the CPU shim is active only without CUDA
        parser.error(f"--device {args.device}: CUDA is {'' if use_cuda else 'not '}available")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before any process group is made
    if world % args.tp:
        parser.error(f"--tp={args.tp} does not divide the world size {world}{' (one process: no torchrun)' * (world == 1)}"
                     f": launch a multiple of {args.tp} processes (torchrun --nproc-per-node {args.tp} ...) or give "
                     f"a --tp that divides {world}")
    problem = None if use_cuda else host_shortfall(max(predicted(mcfg, k, args, world)[0] for k in kinds))
    if problem:  # on CUDA a failed allocation raises; on the CPU the OOM killer ends the process without a word
        parser.error(f"{problem}: reduce {SIZES}")
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, init_distributed, initialize_parallel

    init_distributed("nccl" if use_cuda else "gloo")
    import torch.distributed as dist

    world, rank0 = dist.get_world_size(), dist.get_rank() == 0
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    rows: list[dict] = []
    kind, failure = kinds[0], None
    try:
        groups = initialize_parallel(ParallelConfig(tp=args.tp), seed=1)
        for kind in kinds:
            run_kind(kind, mcfg, args, device, world, groups, into=rows)
    except (KeyboardInterrupt, MemoryError, RuntimeError) as exc:  # one line and the steps measured so far
        if tracebacks_wanted() or not (isinstance(exc, KeyboardInterrupt) or out_of_memory(exc)):
            raise
        where = f"{kind} step {sum(r['optimizer'] == kind for r in rows) + 1}"
        if isinstance(exc, KeyboardInterrupt):
            failure = (130, "interrupted (Ctrl-C, SIGINT)", where)
        else:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            failure = (1, "out of memory", f"{where} ({why}); the planner predicts a "
                          f"{predicted(mcfg, kind, args, world)[0] / GiB:.2f} GiB peak per rank: reduce {SIZES}")
    finally:
        destroy_parallel(wait_for_peers=failure is None)
    if rank0 and rows:
        report(rows, Path(args.out), title + (f" ({failure[1]} at {failure[2].split(' (')[0]})" if failure else ""))
    if failure:
        kept = f"; {len(rows)} measured step(s) written to {args.out}" if rows else "; no step was measured"
        sys.stderr.write(f"{parser.prog}: error: {failure[1]} at {failure[2]}{kept}\n")
        return failure[0]
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the steps (imports, planning, process groups): nothing measured
        if tracebacks_wanted():
            raise
        sys.stderr.write("memory_stress.py: error: interrupted (Ctrl-C, SIGINT) before any step was measured\n")
        sys.exit(130)
