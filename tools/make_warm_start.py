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
import shutil
import sys
import time
from pathlib import Path

from megatron_logra.argtypes import positive_int

ASSET_DIR = Path(__file__).resolve().parents[1] / "megatron_logra" / "assets" / "warm_start_tiny"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=1500, help="supervised steps, sft.steps (default 1500)")
    parser.add_argument("--out", default=str(ASSET_DIR),
                        help="output directory; its model.safetensors, tokenizer/ and info.json are replaced "
                             "(default: the package's shipped megatron_logra/assets/warm_start_tiny)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the tiny recipe, e.g. sft.lr=1e-3")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    from megatron_logra.data.tokenizer import save_tokenizer
    from megatron_logra.overrides import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import build_components
    from megatron_logra.rl.loop import evaluate_accuracy
    from megatron_logra.rl.sft import save_weights

    out = Path(args.out)
    tmp_run = Path("runs/.make_warm_start")
    try:
        cfg = parse_args_to_config("tiny", [f"sft.steps={args.steps}", "sft.init_path=", "tokenizer.path=",
                                             "sft.cache=false", f"train.run_dir={tmp_run}", *args.overrides])
    except ValueError as exc:
        parser.error(f"overrides: {exc}")
    shutil.rmtree(tmp_run, ignore_errors=True)
    t0 = time.perf_counter()
    comps, _, _ = build_components(cfg)
    accuracy = evaluate_accuracy(comps)
    out.mkdir(parents=True, exist_ok=True)
    info = {"steps": args.steps, "eval_accuracy": accuracy, "seconds": time.perf_counter() - t0,
            "model": vars(cfg.model), "task": vars(cfg.task), "tokenizer": vars(cfg.tokenizer)}
    save_weights(comps.model, comps.groups, out / "model.safetensors", meta={"eval_accuracy": accuracy})
    save_tokenizer(comps.tokenizer, out / "tokenizer")
    (out / "info.json").write_text(json.dumps(info, indent=1, default=str))
    destroy_parallel()
    shutil.rmtree(tmp_run, ignore_errors=True)
    print(json.dumps({"out": str(out), "eval_accuracy": accuracy, "seconds": info["seconds"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
