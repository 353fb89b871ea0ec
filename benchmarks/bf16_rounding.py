"""Effect of the bf16-only rounding scheme on learning, side by side in one run.

Trains the lm-tiny recipe with bf16 weights three ways — fp32 masters, bf16-only with
stochastic rounding, bf16-only with round-to-nearest — plus fp32 weights as a reference,
and prints held-out loss before/after and the ratio of loss reduction to the fp32-master run.
With several ``--seeds`` (each sets ``train.seed``: the init, and ``logra.seed``: the projections and
the rounding noise) every variant runs once per seed and the table gives mean ± standard deviation
over the seeds (the ratio per seed, then averaged).

    python benchmarks/bf16_rounding.py [--steps 250] [--lr 3e-3] [--seeds 1234,1,2]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys

from megatron_logra.argtypes import positive_int, report_failed_run

VARIANTS = {
    "fp32 weights": ["model.params_dtype=float32"],
    "bf16 + fp32 masters": ["model.params_dtype=bfloat16", "logra.masters=fp32"],
    "bf16-only, stochastic": ["model.params_dtype=bfloat16", "logra.masters=none", "logra.rounding=stochastic"],
    "bf16-only, nearest": ["model.params_dtype=bfloat16", "logra.masters=none", "logra.rounding=nearest"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=250, help="train.steps of each run (default 250)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="logra.lr and native.lr (default 3e-3)")
    p.add_argument("--run-root", default="runs/bench-bf16",
                   help="directory of the runs, one per variant and seed, replaced if present (default runs/bench-bf16); "
                        "the table goes to stdout only")
    p.add_argument("--seeds", type=seed_list, default="1234", help="comma list of seeds (train.seed and logra.seed)")
    args = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for seed in args.seeds:
        for name, overrides in VARIANTS.items():
            run_dir = f"{args.run_root}/{name.replace(' ', '_').replace(',', '').replace('+', 'plus')}_seed{seed}"
            cmd = [sys.executable, "-m", "megatron_logra.cli", "train", "lm-tiny", f"train.steps={args.steps}",
                   f"logra.lr={args.lr}", f"native.lr={args.lr}", "train.progress=false", "train.eval_interval=0",
                   f"train.run_dir={run_dir}", "train.overwrite=true", f"train.seed={seed}", f"logra.seed={seed}",
                   *overrides]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                return report_failed_run(p, f"megatron-logra train lm-tiny ({name}, seed {seed})", proc.returncode,
                                         proc.stderr)
            out = proc.stdout
            summary = json.loads(out[out.index("{"):])
            # a diverged run's losses are null in the summary (strict JSON): shown as nan here
            rows[name].append({k: float("nan") if summary.get(k) is None else float(summary[k])
                               for k in ("eval_loss_before", "eval_loss_after")})
    ref_gains = [r["eval_loss_before"] - r["eval_loss_after"] for r in rows["bf16 + fp32 masters"]]
    print(f"seeds: {', '.join(map(str, args.seeds))}")
    print(f"{'variant':24s} {'eval before':>11s} {'eval after':>15s} {'gain':>15s} {'gain / fp32-master':>18s}")
    for name, runs in rows.items():
        gains = [r["eval_loss_before"] - r["eval_loss_after"] for r in runs]
        relative = [g / ref if ref else float("nan") for g, ref in zip(gains, ref_gains)]
        print(f"{name:24s} {statistics.fmean(r['eval_loss_before'] for r in runs):11.3f} "
              f"{_mean_sd([r['eval_loss_after'] for r in runs]):>15s} {_mean_sd(gains):>15s} "
              f"{_mean_sd(relative):>18s}")
    return 0


def positive_float(text: str) -> float:
    """``--lr``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


def seed_list(text: str) -> list[int]:
    """``--seeds``: a comma list of distinct ints in [0, 2**31)."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        seeds = [-1]
    if any(not 0 <= s < 2**31 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of distinct ints in [0, 2**31)")
    return seeds


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
