"""RL parity: LoGRA vs dense AdamW on the default recipe, several seeds, side by side in one run.

    python benchmarks/rl_parity.py [--seeds 1 2 3] [--steps 120] [--run-root DIR] [--out STEM] [overrides...]

Each (optimizer, seed) trains in its own subprocess (``megatron-logra train tiny`` or
``tiny-adam`` with ``train.seed`` set), so its peak RSS is measured alone
(``os.wait4``). Prints, and writes to ``STEM.md`` and ``STEM.json``: held-out
accuracy before/after (mean ± sd over seeds), the gain over the warm start, wall time and
peak-memory ratios to dense, and LoGRA's median ``|kl_actual / kl_predicted − 1|``; then the
held-out accuracy at every evaluation point of the runs (mean ± sd), so the comparison is shown
over the whole run and not only at its last step. The files record the command as it was given
(every flag and override).

Where the results go without ``--out``: the documented run (seeds 1 2 3, 120 updates, no
overrides; any ``--run-root``) writes the committed ``benchmarks/results/rl_parity.{md,json}``;
any other run writes ``RUN_ROOT/rl_parity.{md,json}`` beside its runs, so a smoke run never
replaces the committed numbers. ``--out STEM`` writes ``STEM.md`` and ``STEM.json`` (a trailing
``.md`` or ``.json`` is dropped; missing directories are created) wherever it points.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_logra.argtypes import positive_int, report_failed_run
from megatron_logra.bench.outputs import refuse_unwritable

RESULTS = Path(__file__).resolve().parent / "results"
DOCUMENTED = {"seeds": [1, 2, 3], "steps": 120, "overrides": []}
"""The settings of the committed ``results/rl_parity.{md,json}`` (the command the README quotes)."""


class RunFailed(Exception):
    """A training subprocess (``what``) exited ``returncode``; ``stderr`` is what it wrote there."""

    def __init__(self, what: str, returncode: int, stderr: str):
        self.what, self.returncode, self.stderr = what, returncode, stderr
        super().__init__(f"{what} failed with exit code {returncode}")


def _run(recipe: str, seed: int, steps: int, run_root: Path, overrides: list[str]) -> dict:
    run_dir = run_root / f"{recipe}-seed{seed}"
    # the task seed (train/eval partition) stays the warm start's, so the held-out set never overlaps its demonstrations
    cmd = [sys.executable, "-m", "megatron_logra.cli", "train", recipe, f"train.seed={seed}",
           f"rl.steps={steps}", f"train.run_dir={run_dir}", "train.overwrite=true", "train.progress=false", *overrides]
    t0 = time.perf_counter()
    # stderr (the run's log) goes to a file, not a pipe: nothing reads it while stdout is read, so a pipe could fill
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RunFailed(f"megatron-logra train {recipe} (seed {seed})", proc.returncode, err.read())
    summary = json.loads(out[out.index("{"): out.rindex("}") + 1])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    errors = [abs(r["kl_actual"] / r["kl_predicted"] - 1.0) for r in records
              if r.get("kl_predicted") and r.get("kl_actual") is not None]
    return {
        "recipe": recipe, "seed": seed, "wall_seconds": time.perf_counter() - t0,
        "peak_rss_mib": usage.ru_maxrss / 1024.0,
        "eval_before": summary["eval_accuracy_before"], "eval_after": summary["eval_accuracy_after"],
        "kl_rel_error_median": statistics.median(errors) if errors else None,
        "eval_curve": {r["step"]: r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None},
    }


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _curve_table(by: dict, *labelled: tuple[str, str]) -> list[str]:
    """Held-out accuracy (mean ± sd over seeds) at each evaluation step every run of a recipe has."""
    steps = sorted(set.intersection(*(set(x["eval_curve"]) for xs in by.values() for x in xs)), key=int)
    lines = ["| held-out accuracy at update | " + " | ".join(str(s) for s in steps) + " |",
             "|---|" + "---|" * len(steps)]
    for recipe, label in labelled:
        cells = []
        for step in steps:
            mean, sd = _mean_sd([x["eval_curve"][step] for x in by[recipe]])
            cells.append(f"{mean:.3f} ± {sd:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def output_stem(args: argparse.Namespace) -> Path:
    """Where ``STEM.md`` / ``STEM.json`` go (see the module docstring): ``--out`` (without a trailing
    ``.md``/``.json``), else the committed ``results/rl_parity`` for the documented settings, else
    ``RUN_ROOT/rl_parity``."""
    if args.out:
        path = Path(args.out)
        for ext in (".md", ".json"):
            if path.name.endswith(ext) and len(path.name) > len(ext):
                return path.with_name(path.name[: -len(ext)])
        return path
    if {"seeds": list(args.seeds), "steps": args.steps, "overrides": list(args.overrides)} == DOCUMENTED:
        return RESULTS / "rl_parity"
    return Path(args.run_root) / "rl_parity"


def command_line(argv: Sequence[str]) -> str:
    """The command as given, quoted for a shell."""
    return shlex.join(["python", "benchmarks/rl_parity.py", *argv])


def render(rows: list[dict], args: argparse.Namespace, command: str) -> tuple[str, str, dict]:
    """(the tables printed, the Markdown file, the JSON object) of the measured ``rows``."""
    by = {r: [x for x in rows if x["recipe"] == r] for r in ("tiny", "tiny-adam")}
    dense_wall = statistics.mean(x["wall_seconds"] for x in by["tiny-adam"])
    dense_rss = statistics.mean(x["peak_rss_mib"] for x in by["tiny-adam"])
    lines = [
        "| optimizer | held-out before | held-out after (mean ± sd) | gain (points) | wall s | wall ratio | peak RSS MiB | RSS ratio | median KL error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table = {}
    for recipe, label in (("tiny", "LoGRA"), ("tiny-adam", "dense AdamW")):
        xs = by[recipe]
        before, _ = _mean_sd([x["eval_before"] for x in xs])
        after, sd = _mean_sd([x["eval_after"] for x in xs])
        wall = statistics.mean(x["wall_seconds"] for x in xs)
        rss = statistics.mean(x["peak_rss_mib"] for x in xs)
        kl = [x["kl_rel_error_median"] for x in xs if x["kl_rel_error_median"] is not None]
        kl_text = f"{statistics.median(kl):.1%}" if kl else "—"
        table[label] = {"before": before, "after": after, "sd": sd, "wall": wall, "rss": rss}
        lines.append(f"| {label} | {before:.3f} | {after:.3f} ± {sd:.3f} | {100 * (after - before):+.1f} | {wall:.0f} | "
                     f"{wall / dense_wall:.2f} | {rss:.0f} | {rss / dense_rss:.2f} | {kl_text} |")
    logra, dense = table["LoGRA"], table["dense AdamW"]
    verdict = "met" if logra["after"] >= dense["after"] - dense["sd"] else "missed"
    lines += ["", f"LoGRA after {args.steps} updates ≥ dense − 1 sd ({dense['after'] - dense['sd']:.3f}): {verdict}", "",
              *_curve_table(by, ("tiny", "LoGRA"), ("tiny-adam", "dense AdamW"))]
    text = "\n".join(lines)
    extra = f", overrides {' '.join(args.overrides)}" if args.overrides else ""
    md = f"# RL parity (seeds {args.seeds}, {args.steps} updates{extra})\n\nCommand: `{command}`\n\n{text}\n"
    return text, md, {"command": command, "rows": rows, "table": table}


def seed(text: str) -> int:
    """A ``--seeds`` value: an int in [0, 2**31), as ``train.seed`` takes."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer in [0, 2**31)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed, nargs="+", default=[1, 2, 3],
                        help="train.seed of each run, distinct, in [0, 2**31) (default 1 2 3)")
    parser.add_argument("--steps", type=positive_int, default=120, help="RL updates of each run (default 120)")
    parser.add_argument("--run-root", default="runs/bench-rl-parity",
                        help="directory of the runs, RUN_ROOT/RECIPE-seedN, replaced if present "
                             "(default runs/bench-rl-parity)")
    parser.add_argument("--out", default=None, metavar="STEM",
                        help="write STEM.md and STEM.json (default: benchmarks/results/rl_parity for the documented "
                             "--seeds 1 2 3 --steps 120 without overrides, else RUN_ROOT/rl_parity)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to both recipes")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):  # two runs of one seed would share (and overwrite) one run directory
        parser.error(f"argument --seeds: {' '.join(map(str, args.seeds))} repeats a seed")
    stem = output_stem(args)
    refuse_unwritable(parser, "--out", stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json"))
    try:
        rows = [_run(recipe, seed, args.steps, Path(args.run_root), args.overrides)
                for seed in args.seeds for recipe in ("tiny", "tiny-adam")]
    except RunFailed as exc:
        return report_failed_run(parser, exc.what, exc.returncode, exc.stderr)
    text, md, data = render(rows, args, command_line(argv))
    print(text)
    md_path, json_path = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    stem.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(md)
    json_path.write_text(json.dumps(data, indent=1))
    print(f"\nwrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
