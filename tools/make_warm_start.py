"""Produce the warm-start checkpoint shipped with the package for the ``tiny`` recipe.

    python tools/make_warm_start.py [--steps 1500] [overrides...]

Trains the tiny recipe's supervised warm start (dense AdamW on the demonstrations of the recipe's
``sft.teacher``: a careless teacher that echoes ``=`` before 60% of its answers) and writes
``megatron_logra/assets/warm_start_tiny/{model.safetensors,tokenizer/,info.json}``: the whole
model in TP=1 layout with global names (loadable at any TP/PP), the tokenizer it was trained
with, and the held-out accuracy it reached. The ``tiny`` recipe loads it when present, so the
main job starts RL immediately instead of spending minutes on the warm start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from megatron_logra.argtypes import positive_int
from megatron_logra.bench.outputs import why_unwritable

ASSET_DIR = Path(__file__).resolve().parents[1] / "megatron_logra" / "assets" / "warm_start_tiny"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=1500, help="supervised steps, sft.steps (default 1500)")
    parser.add_argument("--out", default=str(ASSET_DIR),
                        help="output directory; its model.safetensors, tokenizer/ and info.json are replaced "
                             "(default: the package's shipped megatron_logra/assets/warm_start_tiny)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the tiny recipe, e.g. sft.lr=1e-3")
    args = parser.parse_args()
    problem = why_unwritable(args.out, directory=True)  # refused now, not after the supervised steps
    if problem:
        parser.error(f"argument --out: {problem}; give a directory this process can create and write")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    from megatron_logra.data.tokenizer import save_tokenizer
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import evaluate_accuracy
    from megatron_logra.rl.sft import save_weights

    out = Path(args.out)
    tmp_run = Path(tempfile.mkdtemp(prefix="make_warm_start_")) / "run"  # the SFT run's scratch directory
    try:
        cfg = parse_args_to_config("tiny", [f"sft.steps={args.steps}", "sft.init_path=", "tokenizer.path=",
                                             "sft.cache=false", f"train.run_dir={tmp_run}", *args.overrides])
    except ValueError as exc:
        shutil.rmtree(tmp_run.parent, ignore_errors=True)
        parser.error(f"overrides: {exc}")
    t0 = time.perf_counter()
    try:
        comps, _, _ = build_components(cfg)
        accuracy = evaluate_accuracy(comps)
        info = {"steps": args.steps, "eval_accuracy": accuracy, "seconds": time.perf_counter() - t0,
                "model": vars(cfg.model), "task": vars(cfg.task), "tokenizer": vars(cfg.tokenizer)}
        # the three outputs are written beside --out first, then moved in: a failure leaves --out as it was
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            save_weights(comps.model, comps.groups, staged / "model.safetensors", meta={"eval_accuracy": accuracy})
            save_tokenizer(comps.tokenizer, staged / "tokenizer")
            (staged / "info.json").write_text(json.dumps(info, indent=1, default=str))
            out.mkdir(exist_ok=True)
            for name in ("model.safetensors", "tokenizer", "info.json"):
                if (out / name).is_dir():
                    shutil.rmtree(out / name)
                os.replace(staged / name, out / name)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        destroy_parallel()
    finally:
        shutil.rmtree(tmp_run.parent, ignore_errors=True)
    print(json.dumps({"out": str(out), "eval_accuracy": accuracy, "seconds": info["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
