"""Effect of the bf16-only rounding scheme on learning, side by side in one run.

Trains the lm-tiny recipe with bf16 weights three ways — fp32 masters, bf16-only with
stochastic rounding, bf16-only with round-to-nearest — plus fp32 weights as a reference,
and prints held-out loss before/after and the ratio of loss reduction to the fp32-master run.

    python benchmarks/bf16_rounding.py [--steps 250] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import json
import logging
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
    p.add_argument("--steps", type=positive_int, default=250)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-root", default="runs/bench-bf16")
    args = p.parse_args()
    rows = {}
    for name, overrides in VARIANTS.items():
        run_dir = f"{args.run_root}/{name.replace(' ', '_').replace(',', '').replace('+', 'plus')}"
        cmd = [sys.executable, "-m", "megatron_logra.cli", "train", "lm-tiny", f"train.steps={args.steps}",
               f"logra.lr={args.lr}", f"native.lr={args.lr}", "train.progress=false", "train.eval_interval=0",
               f"train.run_dir={run_dir}", "train.overwrite=true", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return report_failed_run(p, f"megatron-logra train lm-tiny ({name})", proc.returncode, proc.stderr)
        out = proc.stdout
        summary = json.loads(out[out.index("{"):])
        # a diverged run's losses are null in the summary (strict JSON): shown as nan here
        rows[name] = {k: float("nan") if summary.get(k) is None else float(summary[k])
                      for k in ("eval_loss_before", "eval_loss_after")}
    ref = rows["bf16 + fp32 masters"]
    ref_gain = ref["eval_loss_before"] - ref["eval_loss_after"]
    print(f"{'variant':24s} {'eval before':>11s} {'eval after':>10s} {'gain':>7s} {'gain / fp32-master':>18s}")
    for name, r in rows.items():
        gain = r["eval_loss_before"] - r["eval_loss_after"]
        relative = gain / ref_gain if ref_gain else float("nan")
        print(f"{name:24s} {r['eval_loss_before']:11.3f} {r['eval_loss_after']:10.3f} {gain:7.3f} {relative:18.2f}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
