"""The ``train`` and ``config`` commands, which resolve a config the same way: a recipe or YAML file with
overrides, or a saved run's config (``--resume RUN_DIR``), checked before anything is built. ``config`` then
prints it; ``train`` runs its job (RL or LM) and prints the run's summary.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Optional, Sequence

import yaml

from megatron_logra.cli.errors import exit_with_error, reporting_user_errors, tracebacks_wanted, user_error
from megatron_logra.cli.launch import check_same_config_on_every_rank, is_rank0
from megatron_logra.cli.resume import check_recipe_resume, check_resumed_architecture, split_resume_dir
from megatron_logra.cli.run_dir import run_dir_config
from megatron_logra.wandb_log import check_wandb

logger = logging.getLogger(__name__)

FLOAT16_WARNING = (
    "model.params_dtype=float16 (--fp16) with optimizer.loss_scale.mode=none trains without loss scaling: "
    "gradients below float16's range (about 6e-8) are lost to zero; drop optimizer.loss_scale.mode=none for "
    "dynamic loss scaling (as Megatron-LM's --fp16), or train in bfloat16 (--bf16), which has float32's range")
"""Logged (rank 0) by ``train`` and ``config`` for a float16 run whose loss scaling is turned off."""

if TYPE_CHECKING:
    from megatron_logra.config import RunConfig

__all__ = ["INTERRUPTED_STATUS", "job_check_config", "run_train_or_config", "split_recipe"]

INTERRUPTED_STATUS = 130
"""Exit status of a ``train`` stopped by Ctrl-C (SIGINT), as a shell reports a process ended by SIGINT."""


def split_recipe(args: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """``[RECIPE, OVERRIDE ...]`` -> ``(RECIPE, [OVERRIDE ...])``: the first argument is the recipe (a name or a
    YAML file) unless it is a flag or an override ``key=value``, in which case the recipe is None (the default)."""
    if args and not args[0].startswith("-") and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def job_check_config(cfg: RunConfig) -> None:
    """What ``megatron-logra config`` checks beyond the config's own validation: the configured job's start-time
    checks that need no process group, model or GPU and write nothing (:func:`megatron_logra.rl.job.check_config`,
    :func:`megatron_logra.train.lm.check_config`), which ``train`` runs too."""
    if cfg.job == "rl":
        from megatron_logra.rl.job import check_config
    else:
        from megatron_logra.train.lm import check_config
    check_config(cfg)


def run_train_or_config(parser: argparse.ArgumentParser, command: str, rest: Sequence[str]) -> int:
    """``megatron-logra train|config [RECIPE | FILE.yaml | --resume RUN_DIR] [OVERRIDE ...]``; ``rest`` is what
    follows the command. Bad input is reported through ``parser`` (``megatron-logra: error: ...``, exit status 2)
    before anything is built. ``config`` writes the resolved config (credentials redacted) to stdout as YAML;
    ``train`` runs the job, tears the process group down, and rank 0 writes the summary to stdout as JSON.
    Returns the exit status (0)."""
    from megatron_logra.config import parse_args_to_config

    resume_dir, rest = split_resume_dir(rest)
    try:
        if resume_dir is not None:
            cfg = run_dir_config(resume_dir, rest, command=command)
        else:
            recipe, overrides = split_recipe(rest)
            cfg = parse_args_to_config(recipe, overrides)
    except ValueError as exc:
        user_error(parser, exc)
    check_resumed_architecture(parser, cfg)
    if cfg.model.params_dtype == "float16" and cfg.optimizer.loss_scale.mode == "none" and is_rank0():
        logger.warning(FLOAT16_WARNING)
    reporting_user_errors(parser, lambda: check_wandb(cfg.train))  # before anything is built, on every rank
    if resume_dir is None and cfg.train.resume:
        reporting_user_errors(parser, lambda: check_recipe_resume(cfg))
    if command == "config":
        import copy

        from megatron_logra.config import to_dict
        from megatron_logra.rollout.sglang_setup import redact_config

        # the job's own checks that build nothing (a copy: they may fill in what the job derives, as it does)
        reporting_user_errors(parser, lambda: job_check_config(copy.deepcopy(cfg)))
        sys.stdout.write(yaml.safe_dump(redact_config(to_dict(cfg)), sort_keys=False))  # output often goes to a file
        return 0

    from megatron_logra.parallel import destroy_parallel

    if cfg.job == "rl":
        from megatron_logra.rl.job import run_rl as run
    else:
        from megatron_logra.train.lm import run_lm as run
    from megatron_logra.train.stopping import catching_interrupts
    from megatron_logra.train.stopping import interrupted as ctrl_c_received

    def checked_run() -> dict:
        check_same_config_on_every_rank(cfg, command)  # a rank given other arguments fails here, not mid-step
        try:
            return run(cfg)
        except Exception:
            if ctrl_c_received():  # Ctrl-C that code under way (a save) turned into an error of its own: still Ctrl-C
                raise KeyboardInterrupt from None
            raise

    succeeded = interrupted = False
    try:
        with catching_interrupts():
            summary = reporting_user_errors(parser, checked_run)
        succeeded = True
    except KeyboardInterrupt:  # Ctrl-C: one line saying how to continue, not a traceback from wherever it landed
        if tracebacks_wanted():
            raise
        interrupted = True
    finally:
        destroy_parallel(wait_for_peers=succeeded)
    if interrupted:
        exit_with_error(INTERRUPTED_STATUS, f"{parser.prog}: interrupted (Ctrl-C, SIGINT); {_how_to_continue(cfg)}\n")
    if is_rank0():
        from megatron_logra.metrics import strict_dumps

        sys.stdout.write(strict_dumps(summary, indent=1) + "\n")  # as summary.json: null for a non-finite value
    return 0


def _how_to_continue(cfg: RunConfig) -> str:
    """What a user whose run was interrupted can do: resume from its latest checkpoint, or start it over."""
    from megatron_logra.checkpoint import latest_checkpoint

    run_dir = cfg.train.run_dir
    try:
        latest = latest_checkpoint(run_dir)
    except (ValueError, OSError) as exc:  # a CheckpointError: what it says is what to do
        return f"its checkpoints need attention: {exc}"
    if latest is None:
        from pathlib import Path

        if any((Path(run_dir) / name).exists() for name in ("metrics.jsonl", "summary.json", "checkpoints")):
            return (f"no checkpoint was saved in {run_dir}: start the run again with train.overwrite=true (which "
                    f"replaces what it wrote there) or in another train.run_dir")
        return "no checkpoint was saved, and nothing to continue: run the command again"
    return (f"the run's latest checkpoint is {latest} (an unfinished save is discarded): continue with "
            f"`megatron-logra train --resume {run_dir}`")
