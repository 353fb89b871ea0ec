"""The ``eval`` command: held-out accuracy (RL) or loss (LM) of a run's latest checkpoint (or the one of
``--ckpt-step N``), with the run's saved config (overrides on top), printed as JSON. It never writes into the run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_logra.cli.errors import reporting_user_errors, user_error
from megatron_logra.cli.launch import check_same_config_on_every_rank, is_rank0
from megatron_logra.cli.resume import check_resumed_architecture
from megatron_logra.cli.run_dir import run_dir_config
from megatron_logra.rewards.process_pool import closing_reward_workers

__all__ = ["run_eval"]


def _ckpt_step(args: list[str]) -> tuple[Optional[int], list[str]]:
    """``--ckpt-step N`` (or ``--ckpt-step=N``) taken out of ``args``: ``(N or None, the other arguments)``;
    ``ValueError`` for a value that is no step number or a flag given twice."""
    step: Optional[int] = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--ckpt-step" or arg.startswith("--ckpt-step="):
            if step is not None:
                raise ValueError("--ckpt-step is given twice; give the one step to evaluate")
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit():
                raise ValueError(f"--ckpt-step {value!r}: give the step of a saved checkpoint, e.g. --ckpt-step 20")
            step = int(value)
            continue
        rest.append(arg)
        i += 1
    return step, rest


def run_eval(parser: argparse.ArgumentParser, rest: Sequence[str]) -> int:
    """``megatron-logra eval RUN_DIR [OVERRIDE ...]``; ``rest`` is what follows ``eval``. Bad input (no run
    directory, a run without a checkpoint or without a held-out set, ...) is reported through ``parser``
    (``megatron-logra: error: ...``, exit status 2) before anything is built; then the checkpoint is evaluated,
    the process group torn down, and rank 0 writes the result to stdout as JSON (``run_dir``, ``step``,
    ``eval_accuracy``, ``num_eval`` for RL; :func:`megatron_logra.train.lm_eval.evaluate_checkpoint`'s for LM).
    Returns the exit status (0)."""
    from megatron_logra.parallel import destroy_parallel

    if not rest:
        parser.error("eval needs a run directory")
    run_dir = Path(rest[0])
    checkpoint = None
    try:
        step, overrides = _ckpt_step(list(rest[1:]))
        cfg = run_dir_config(run_dir, overrides, command="eval", progress=False)
        if step is not None:
            from megatron_logra.checkpoint.catalog import checkpoint_at_step

            checkpoint = checkpoint_at_step(run_dir, step)
        if cfg.job == "rl" and cfg.task.num_eval == 0:
            raise ValueError(f"task.num_eval=0: {run_dir} has no held-out set to evaluate; give task.num_eval=N "
                             f"(e.g. task.num_eval=200) to evaluate the run on N held-out problems")
    except ValueError as exc:
        user_error(parser, exc)
    check_resumed_architecture(parser, cfg)

    @closing_reward_workers  # task.reward_workers started by the held-out scoring end with the command
    def evaluate() -> dict:
        check_same_config_on_every_rank(cfg, "eval")  # a rank given other arguments fails here, not mid-load
        if cfg.job == "rl":
            from megatron_logra.rl.job import build_components
            from megatron_logra.rl.evaluation import evaluate_held_out

            comps, state, _ = build_components(cfg, for_eval=True, checkpoint=checkpoint)
            accuracy, by_source = evaluate_held_out(comps)  # a mixture: also eval_accuracy/SOURCE per source
            return {"run_dir": str(run_dir), "step": state.step, "eval_accuracy": accuracy,
                    "num_eval": len(comps.task.eval_problems()), "eval_sources": comps.task.eval_names, **by_source}
        from megatron_logra.train.lm_eval import evaluate_checkpoint

        return evaluate_checkpoint(cfg, checkpoint)

    succeeded = False
    try:
        result = reporting_user_errors(parser, evaluate)
        succeeded = True
    finally:
        destroy_parallel(wait_for_peers=succeeded)
    if is_rank0():
        from megatron_logra.metrics import strict_dumps

        sys.stdout.write(strict_dumps(result, indent=1) + "\n")
    return 0
