"""Dynamic sampling on vs off on the main job, several seeds, side by side in one run.

    python benchmarks/dynamic_sampling.py [--seeds 1 2 3] [--steps 60] [--rounds 2] [--run-root DIR] [--out STEM]
                                          [overrides...]

Each (variant, seed) trains ``megatron-logra train tiny`` in its own subprocess with ``train.seed`` set and
``rl.dynamic_sampling_rounds`` 0 (off) or ``--rounds``. Prints, and writes to ``STEM.md`` and ``STEM.json``: held-out
greedy accuracy before / after (mean ± sd over seeds), the groups of equal rewards left in the batches and the
extra rounds per update, the rollouts generated and the wall time, each as a ratio to the run without dynamic
sampling. Without ``--out`` the documented run (seeds 1 2 3, 60 updates, 2 rounds, no overrides) writes the
committed ``benchmarks/results/dynamic_sampling.{md,json}``; any other run writes ``RUN_ROOT/dynamic_sampling.*``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from megatron_logra.bench.outputs import refuse_unwritable

RESULTS = Path(__file__).resolve().parent / "results"
DOCUMENTED = {"seeds": [1, 2, 3], "steps": 60, "rounds": 2, "overrides": []}
"""The settings of the committed ``results/dynamic_sampling.{md,json}``."""


def run_one(seed: int, rounds: int, steps: int, run_root: Path, overrides: list[str]) -> dict:
    """Train ``tiny`` once; the measured row (see the module doc)."""
    run_dir = run_root / f"rounds{rounds}-seed{seed}"
    cmd = [sys.executable, "-m", "megatron_logra.cli", "train", "tiny", f"train.seed={seed}", f"rl.steps={steps}",
           f"rl.dynamic_sampling_rounds={rounds}", f"train.run_dir={run_dir}", "train.overwrite=true",
           "train.progress=false", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{shlex.join(cmd)} failed with exit code {proc.returncode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"seed": seed, "rounds": rounds, "wall_seconds": time.perf_counter() - t0,
            "eval_before": summary["eval_accuracy_before"], "eval_after": summary["eval_accuracy_after"],
            "uniform_per_update": statistics.mean(r["groups_uniform"] for r in records),
            "extra_rounds_per_update": statistics.mean(r["resample_rounds"] for r in records),
            "skipped": sum(bool(r["skipped"]) for r in records), "updates": len(records)}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def render(rows: list[dict], rounds: int) -> tuple[str, dict]:
    """(the table, its numbers) of the measured ``rows``: off (0 rounds) first, ratios to it."""
    table: dict[str, dict] = {}
    for r in (0, rounds):
        xs = [x for x in rows if x["rounds"] == r]
        after, sd = _mean_sd([x["eval_after"] for x in xs])
        table[str(r)] = {
            "before": statistics.mean(x["eval_before"] for x in xs), "after": after, "sd": sd,
            "uniform": statistics.mean(x["uniform_per_update"] for x in xs),
            "extra_rounds": statistics.mean(x["extra_rounds_per_update"] for x in xs),
            "wall": statistics.mean(x["wall_seconds"] for x in xs),
        }
    off = table["0"]
    lines = ["| dynamic sampling | held-out before | held-out after (mean ± sd) | gain (points) | uniform groups left "
             "/ update | extra rounds / update | rollouts generated ratio | wall s | wall ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, label in ((0, "off"), (rounds, f"{rounds} rounds")):
        t = table[str(r)]
        lines.append(f"| {label} | {t['before']:.3f} | {t['after']:.3f} ± {t['sd']:.3f} | "
                     f"{100 * (t['after'] - t['before']):+.1f} | {t['uniform']:.2f} | {t['extra_rounds']:.2f} | "
                     f"{(1 + t['extra_rounds']) / (1 + off['extra_rounds']):.2f} | {t['wall']:.0f} | "
                     f"{t['wall'] / off['wall']:.2f} |")
    return "\n".join(lines), table


def output_stem(args: argparse.Namespace) -> Path:
    """Where ``STEM.md`` / ``STEM.json`` go (see the module doc; a trailing ``.md`` / ``.json`` of ``--out`` is
    dropped)."""
    if args.out:
        for ext in (".md", ".json"):
            if args.out.endswith(ext) and len(Path(args.out).name) > len(ext):
                return Path(args.out[: -len(ext)])
        return Path(args.out)
    given = {"seeds": list(args.seeds), "steps": args.steps, "rounds": args.rounds, "overrides": list(args.overrides)}
    return RESULTS / "dynamic_sampling" if given == DOCUMENTED else Path(args.run_root) / "dynamic_sampling"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="train.seed of each run (default 1 2 3)")
    parser.add_argument("--steps", type=int, default=60, help="RL updates of each run (default 60)")
    parser.add_argument("--rounds", type=int, default=2, help="rl.dynamic_sampling_rounds of the 'on' runs (default 2)")
    parser.add_argument("--run-root", default="runs/bench-dynamic-sampling", help="parent of the run directories")
    parser.add_argument("--out", default=None, metavar="STEM", help="write STEM.md and STEM.json")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    stem = output_stem(args)
    md, js = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    refuse_unwritable(parser, "--out", md, js)  # before the runs, not after them
    run_root = Path(args.run_root)
    rows = [run_one(seed, r, args.steps, run_root, args.overrides) for seed in args.seeds for r in (0, args.rounds)]
    text, table = render(rows, args.rounds)
    command = shlex.join(["python", "benchmarks/dynamic_sampling.py", *argv])
    print(text)
    stem.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(f"# Dynamic sampling (seeds {args.seeds}, {args.steps} updates)\n\nCommand: `{command}`\n\n{text}\n")
    js.write_text(json.dumps({"command": command, "rows": rows, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
