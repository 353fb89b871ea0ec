"""Dynamic micro-batches (``rl.max_tokens_per_micro_batch``) vs fixed ones on a step of long-tailed completion
lengths, side by side in one run.

    python benchmarks/dynamic_batch.py [--hidden 256] [--layers 4] [--seq 512] [--rows 64] [--long-share 0.15]
                                       [--micro-batch 8] [--repeats 3] [--out STEM]

One RL step's forward/backward and prepare (CPU megatron GPT, LoGRA) runs on the same batch: ``--rows`` sequences
of a 32-token prompt and a completion, ``--long-share`` of them long (``0.5–0.9 × --seq``) and the rest short
(16–64 tokens), as reasoning rollouts are. The fixed layout is ``--micro-batch`` sequences per micro-batch padded
to the step's longest; the dynamic ones have token budgets of ``--micro-batch × --seq`` (no micro-batch larger
than a fixed one can be) and half of it. Prints, and writes to ``STEM.md`` / ``STEM.json``: micro-batches, positions computed (ratio to fixed), the step's median wall
time over ``--repeats`` alternating runs (ratio to fixed), and the largest relative difference of the reduced
gradient sketches to the fixed layout's (the same update up to the order of float sums). Only the documented run
(the defaults) writes the committed ``benchmarks/results/dynamic_batch.{md,json}`` without ``--out``; any other
writes ``runs/bench-dynamic-batch/dynamic_batch.*``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from megatron_logra.bench.outputs import refuse_unwritable

RESULTS = Path(__file__).resolve().parent / "results"
DOCUMENTED = {"hidden": 256, "layers": 4, "seq": 512, "rows": 64, "long_share": 0.15, "micro_batch": 8, "repeats": 3}
"""The settings of the committed ``results/dynamic_batch.{md,json}``."""


def _components(args, run_dir: Path):
    import torch

    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rl.components import build_components

    torch.set_num_threads(max(1, torch.get_num_threads()))
    heads = max(4, args.hidden // 64)
    cfg = parse_args_to_config("tiny", [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.num_attention_heads={heads}",
        f"model.ffn_hidden_size={4 * args.hidden}", f"model.seq_length={args.seq}", "sft.steps=0", "sft.init_path=",
        "tokenizer.path=", "task.num_eval=0", "rl.eval_interval=0", "train.progress=false",
        f"rl.micro_batch_size={args.micro_batch}", f"train.run_dir={run_dir}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, _, _ = build_components(cfg)
    return comps


def _batch(comps, args):
    from megatron_logra.rl.batching import pack_sequences

    gen = random.Random(0)
    vocab = len(comps.tokenizer)
    lengths = [gen.randint(int(0.5 * args.seq), int(0.9 * args.seq)) if gen.random() < args.long_share
               else gen.randint(16, 64) for _ in range(args.rows)]
    prompts = [[gen.randrange(1, vocab) for _ in range(32)] for _ in lengths]
    completions = [[gen.randrange(1, vocab) for _ in range(min(n, args.seq - 32))] for n in lengths]
    return pack_sequences(prompts, completions, rollout_logprobs=[[-1.0] * len(c) for c in completions],
                          advantages=[gen.uniform(-1, 1) for _ in lengths], finished=[True] * len(lengths),
                          pad_id=comps.tokenizer.pad_token_id, max_length=comps.cfg.model.seq_length,
                          multiple=comps.cfg.sequence_multiple())


def _step(comps, batch, budget: int):
    """(seconds, micro-batches, positions, reduced sketches) of one forward/backward + prepare."""
    from megatron_logra.profiling.phases import Phases
    from megatron_logra.rl.objective import backward_and_prepare, make_rl_loss_fn, step_plan

    comps.cfg.rl.max_tokens_per_micro_batch = budget
    plan = step_plan(comps, batch)
    loss_fn = make_rl_loss_fn(comps.cfg.rl.loss, comps.cfg.rl.rollout.temperature, comps.groups.tp)
    t0 = time.perf_counter()
    with Phases("bench") as ph:
        backward_and_prepare(comps, batch, loss_fn, 1, ph)
    seconds = time.perf_counter() - t0
    sketches = {t.key: t.sketch.double().clone() for t in comps.optimizer.targets}
    return seconds, len(plan), sum(len(p.rows) * p.length for p in plan), sketches


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=DOCUMENTED["hidden"])
    p.add_argument("--layers", type=int, default=DOCUMENTED["layers"])
    p.add_argument("--seq", type=int, default=DOCUMENTED["seq"])
    p.add_argument("--rows", type=int, default=DOCUMENTED["rows"])
    p.add_argument("--long-share", type=float, default=DOCUMENTED["long_share"])
    p.add_argument("--micro-batch", type=int, default=DOCUMENTED["micro_batch"])
    p.add_argument("--repeats", type=int, default=DOCUMENTED["repeats"])
    p.add_argument("--out", default=None, help="STEM of the .md / .json written (see the module doc)")
    return p


def output_stem(args: argparse.Namespace) -> Path:
    """Where the tables go: ``--out`` (its suffix dropped), else the committed results for the documented run,
    else ``runs/bench-dynamic-batch/dynamic_batch``."""
    if args.out:
        out = Path(args.out)
        return out.with_suffix("") if out.suffix in (".md", ".json") else out
    if all(getattr(args, k) == v for k, v in DOCUMENTED.items()):
        return RESULTS / "dynamic_batch"
    return Path("runs/bench-dynamic-batch/dynamic_batch")


def _file(stem: Path, suffix: str) -> Path:
    return stem.parent / (stem.name + suffix)


def render(rows: list[dict], header: str) -> str:
    """The markdown table of the measured ``rows`` (the fixed layout first), under ``header``: ratios to the
    first row's positions and median time."""
    base = rows[0]
    lines = [header, "", "| layout | micro-batches | positions | positions ratio | step s | time ratio | "
             "sketch rel. diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['micro_batches']} | {r['positions']} | "
                     f"{r['positions'] / base['positions']:.2f} | {r['seconds']:.2f} | "
                     f"{r['seconds'] / base['seconds']:.2f} | {r['sketch_rel_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.seq % 8 or args.seq < 128 or not 0 <= args.long_share <= 1 or args.rows < 1 or args.repeats < 1:
        p.error("--seq must be a multiple of 8 and >= 128, --long-share in [0, 1], --rows and --repeats >= 1")
    stem = output_stem(args)
    refuse_unwritable(p, "--out", _file(stem, ".md"), _file(stem, ".json"))

    from megatron_logra.parallel import destroy_parallel

    full = args.micro_batch * args.seq
    variants = [("fixed", 0), (f"dynamic, {full} tokens", full), (f"dynamic, {full // 2} tokens", full // 2)]
    with tempfile.TemporaryDirectory() as tmp:
        comps = _components(args, Path(tmp) / "run")
        try:
            batch = _batch(comps, args)
            _step(comps, batch, 0)  # warm-up
            times: dict[str, list[float]] = {name: [] for name, _ in variants}
            shape: dict[str, tuple[int, int]] = {}
            sketches: dict[str, dict] = {}
            for _ in range(args.repeats):
                for name, budget in variants:
                    seconds, num_micro, positions, sk = _step(comps, batch, budget)
                    times[name].append(seconds)
                    shape[name], sketches[name] = (num_micro, positions), sk
        finally:
            destroy_parallel()
    rows = []
    for name, budget in variants:
        diff = max(((sketches[name][k] - v).abs().max() / v.abs().max()).item() for k, v in sketches["fixed"].items())
        rows.append({"layout": name, "budget": budget, "micro_batches": shape[name][0], "positions": shape[name][1],
                     "seconds": statistics.median(times[name]), "sketch_rel_diff": diff})
    table = render(rows, f"hidden {args.hidden}, {args.layers} layers, seq {args.seq}, {args.rows} sequences "
                         f"({args.long_share:.0%} long), {batch.loss_mask.sum():.0f} loss tokens; median of "
                         f"{args.repeats} alternating runs")
    sys.stdout.write(table + "\n")
    stem.parent.mkdir(parents=True, exist_ok=True)
    _file(stem, ".md").write_text(table + "\n")
    _file(stem, ".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
