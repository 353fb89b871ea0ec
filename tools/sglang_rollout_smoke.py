"""GPU smoke test of the RL job with SGLang rollouts (``rl.rollout.engine=sglang``) on one GPU.

    python tools/sglang_rollout_smoke.py [--recipe tiny] [--steps 3] [--url http://host:port]
                                         [--engine-arg KEY=JSON ...] [--max-logprob-gap 0.05] [--json out.json]

Builds the job exactly as ``megatron-logra train`` does (``rl.components.build_components``: the trainer,
an in-process ``sglang.Engine`` started with the sketch-delta loader, or the server at ``--url``,
loaded by one full refit), then runs ``--steps`` RL updates and checks:

1. every update synced by sketch delta with no drift (``sync.check_interval=1``: the engine's
   fingerprint, read back through the loader, equals the trainer's after every update);
2. the engine's ``weight_version`` equals the job's after the last update;
3. rollouts generated after the last update carry log-probs within ``--max-logprob-gap`` (mean
   absolute, per token) of the trainer's own ``log_softmax(z / T)`` recomputed with a fresh forward,
   i.e. SGLang's log-prob convention and the padded-vocabulary bias match the trainer's.

The trainer runs in bfloat16 (``model.params_dtype=bfloat16``, whatever the recipe says): the
in-process engine runs in the trainer's dtype, and SGLang's kernels are float16 / bfloat16 only.

Prints the per-update metrics, the numbers and PASS/FAIL (exit status 0/1; 3 when it cannot run here:
no CUDA device, or SGLang not installed and no ``--url``). The tiny recipe with its
shipped warm start needs about 1-3 minutes, most of it SGLang start-up. SGLang's default attention
kernels want head dims of 64/128/256: the tiny model's are smaller, so ``attention_backend`` defaults
to ``torch_native`` here (override with ``--engine-arg attention_backend='"triton"'``).
``tests/gpu/test_sglang_rollout_engine.py`` runs :func:`run` for two updates.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_logra.argtypes import key_json, positive_int

CANNOT_RUN = 3
"""Exit status when the smoke test cannot run here (no CUDA device, SGLang not installed): nothing was checked."""
EPILOG = (f"Exit status: 0 every check passed, 1 a check failed, 2 a bad argument, {CANNOT_RUN} nothing could run "
          "here (no CUDA device, or SGLang not installed without --url).")

DEFAULT_ENGINE_ARGS = {"attention_backend": "torch_native", "disable_cuda_graph": True, "disable_radix_cache": True}


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (``--max-logprob-gap``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0")
    return value


def cannot_run(*, need_sglang: bool) -> Optional[str]:
    """Why the smoke test cannot run on this machine, or None: SGLang missing (when an in-process engine is
    needed), no CUDA device."""
    if need_sglang:
        try:
            importlib.import_module("sglang")
        except ImportError:
            return ("SGLang is not installed (pip install 'megatron-logra[sglang]', or give --url of a running "
                    "server)")
    if not torch.cuda.is_available():
        return "no CUDA device (this smoke test runs the trainer and SGLang on one GPU)"
    return None


def log(msg: str) -> None:
    print(f"[sglang-rollout] {msg}", flush=True)


def trainer_logprobs(comps: Any, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The trainer's ``log_softmax(z / T)`` at ``completion`` from one fresh forward (float64)."""
    from megatron_logra.train.step import model_device

    seq = prompt + completion
    device = model_device(comps.model)
    tokens = torch.tensor([seq], device=device)
    pos = torch.arange(len(seq), device=device)[None]
    with torch.no_grad():
        logits = comps.model(tokens, pos, None)
    logp = torch.log_softmax(logits[0].double() / (temperature or 1.0), dim=-1)
    return [float(logp[t - 1, seq[t]]) for t in range(len(prompt), len(seq))]


def smoke_config(steps: int = 3, *, recipe: str = "tiny", url: str = "", engine_args: Optional[dict] = None,
                 run_dir: Optional[Path] = None) -> Any:
    """The recipe with SGLang rollouts, ``steps`` updates, delta sync checked after every update.

    The trainer runs in bfloat16 (``model.params_dtype``; the tiny recipe is float32): an in-process
    engine runs in the trainer's dtype and SGLang's kernels are fp16/bf16 only
    (``sglang_checks.check_engine_dtype``). fp32 masters keep the exact trajectory; the engine's
    fingerprint is compared in bf16, as ``tests/unit/test_rl_bf16_sync.py`` checks on the CPU."""
    from megatron_logra.config import load_recipe

    cfg = load_recipe(recipe)
    cfg.model = dataclasses.replace(cfg.model, params_dtype="bfloat16")
    rollout = {"engine": "sglang", "sglang_url": url, "mem_fraction_static": 0.3,
               "sglang_engine_args": {**DEFAULT_ENGINE_ARGS, **(engine_args or {})}}
    cfg.rl = dataclasses.replace(cfg.rl, steps=steps, eval_interval=0,
                                 rollout=dataclasses.replace(cfg.rl.rollout, **rollout))
    # no master re-anchor (sync.max_master_drift=0): every update must travel as a delta alone
    cfg.sync = dataclasses.replace(cfg.sync, mode="delta", check_interval=1, anchor_interval=0, max_master_drift=0.0)
    cfg.train = dataclasses.replace(cfg.train, run_dir=str(run_dir or tempfile.mkdtemp(prefix="logra-sglang-rl-")),
                                    progress=False)
    return cfg.validate()


def logprob_gap_check(gaps: list[float], max_gap: float) -> tuple[float, Optional[float], str, Optional[str]]:
    """Check 3 of the module docstring on the per-token ``|rollout - trainer|`` log-prob ``gaps``:
    (mean, max or None, the line to report, the failure or None). No token at all (every rollout
    ended at once, e.g. EOS first) is a failure: nothing was compared."""
    if not gaps:
        return (float("nan"), None, "rollout vs trainer log-probs: no rollout produced a token, nothing to compare",
                "no completion token to compare log-probs on (every rollout was empty, e.g. EOS first)")
    mean, top = statistics.mean(gaps), max(gaps)
    line = f"rollout vs trainer log-probs over {len(gaps)} tokens: mean |gap| {mean:.4f}, max {top:.4f}"
    failure = None if mean <= max_gap else f"mean |rollout - trainer log-prob| {mean:.4f} > {max_gap}"
    return mean, top, line, failure


def run(steps: int = 3, *, recipe: str = "tiny", url: str = "", engine_args: Optional[dict] = None,
        max_logprob_gap: float = 0.05, run_dir: Optional[Path] = None, report: Callable[[str], None] = log) -> dict:
    """Build the job with SGLang rollouts, run ``steps`` updates, check 1-3 of the module docstring."""
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.rl.prompts import _prompt_ids
    from megatron_logra.rollout.engine import SamplingParams

    cfg = smoke_config(steps, recipe=recipe, url=url, engine_args=engine_args, run_dir=run_dir)
    failures: list[str] = []
    t0 = time.perf_counter()
    comps, state, _ = build_components(cfg)
    setup_s = time.perf_counter() - t0
    report(f"job built in {setup_s:.0f}s (engine at version {comps.engine.weight_version})")
    records = []
    try:
        for _ in range(steps):
            rec = rl_update(comps, state)
            records.append(rec)
            report(f"step {rec['step']}: reward {rec['reward_mean']:.3f} mismatch {rec['mismatch']} alpha "
                   f"{rec['alpha']} sync {rec['sync_mode']} drift {rec['sync_drift']} "
                   f"rollout {rec['rollout_seconds']:.2f}s")
            if not rec["skipped"] and (rec["sync_mode"] != "delta" or rec["sync_drift"]):
                failures.append(f"step {rec['step']}: sync_mode={rec['sync_mode']} sync_drift={rec['sync_drift']}")
        if comps.engine.weight_version != state.weight_version:
            failures.append(f"engine at version {comps.engine.weight_version}, job at {state.weight_version}")
        temperature = cfg.rl.rollout.temperature
        problems = [comps.task.train_problem(10_000 + i) for i in range(8)]
        params = SamplingParams(temperature=temperature, max_new_tokens=cfg.rl.rollout.max_new_tokens,
                                stop_token_ids=[comps.tokenizer.eos_token_id], seed=1)
        rollouts = comps.engine.generate([_prompt_ids(comps, p.prompt) for p in problems], params)
        gaps = [abs(a - b) for r in rollouts
                for a, b in zip(r.logprobs, trainer_logprobs(comps, r.prompt_ids, r.completion_ids, temperature))]
        gap, gap_max, line, problem = logprob_gap_check(gaps, max_logprob_gap)
        report(line)
        if problem:
            failures.append(problem)
    finally:
        if hasattr(comps.engine, "close"):
            comps.engine.close()
        destroy_parallel()
    for f in failures:
        report(f"FAIL: {f}")
    return {"passed": not failures, "failures": failures, "setup_s": setup_s, "logprob_gap_mean": gap,
            "logprob_gap_max": gap_max, "records": records}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG)
    p.add_argument("--recipe", default="tiny", help="recipe name or YAML file (default tiny)")
    p.add_argument("--steps", type=positive_int, default=3, help="RL updates (default 3)")
    p.add_argument("--url", default="", help="a running SGLang server (with the sketch-delta loader); default: an "
                   "in-process sglang.Engine")
    p.add_argument("--engine-arg", type=key_json, action="append", default=[], metavar="KEY=JSON",
                   help="extra sglang.Engine args (repeatable)")
    p.add_argument("--max-logprob-gap", type=non_negative_float, default=0.05,
                   help="largest mean |rollout - trainer| log-prob per token (default 0.05)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    try:
        from megatron_logra.config import load_recipe

        load_recipe(args.recipe)
    except (ValueError, OSError) as exc:
        p.error(f"argument --recipe: {exc}")
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        p.error(f"argument --json: {args.json} is a directory or its directory does not exist")
    problem = cannot_run(need_sglang=not args.url)
    if problem:
        print(f"{p.prog}: {problem}: nothing was checked", file=sys.stderr)
        return CANNOT_RUN
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    extra = dict(args.engine_arg)
    res = run(args.steps, recipe=args.recipe, url=args.url, engine_args=extra, max_logprob_gap=args.max_logprob_gap)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, default=str))
    log("PASS" if res["passed"] else "FAIL")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
