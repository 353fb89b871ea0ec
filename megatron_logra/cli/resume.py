"""Resuming a run: the ``--resume`` argument's forms, and the checks that a resumed run continues the run it names.

* ``--resume RUN_DIR`` / ``--resume=RUN_DIR`` takes the run's saved config (:func:`split_resume_dir` finds it;
  :func:`megatron_logra.cli.run_dir.run_dir_config` reads it);
* a bare ``--resume`` (``train.resume=true``) with a recipe must give the run's saved config, launch settings
  aside (:data:`RESUME_LAUNCH_FIELDS`, :func:`resume_differences`, :func:`check_recipe_resume`);
* either way the latest checkpoint's architecture must be the config's (:func:`check_resumed_architecture`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import yaml

from megatron_logra.cli.errors import reporting_user_errors
from megatron_logra.cli.launch import is_rank0

if TYPE_CHECKING:
    from megatron_logra.config import RunConfig

__all__ = ["RESUME_LAUNCH_FIELDS", "check_recipe_resume", "check_resumed_architecture", "resume_differences",
           "split_resume_dir"]

logger = logging.getLogger(__name__)

_BOOLEAN_WORDS = frozenset({"1", "0", "true", "false", "yes", "no", "on", "off"})
"""What a boolean field parses: ``--resume=true`` is ``train.resume=true``."""


_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*=")
"""The start of a ``key=value`` / ``a.b=value`` override (a path such as ``/runs/lr=0.1`` is not one)."""


def _is_run_dir_arg(arg: str) -> bool:
    """Whether ``arg``, the word after ``--resume``, is a run directory: not a flag, and an existing directory or
    anything that does not start like a dotted override (``/runs/lr=0.1/a`` is a directory, ``rl.steps=9`` an
    override of a bare ``--resume``)."""
    return not arg.startswith("-") and (os.path.isdir(arg) or not _OVERRIDE.match(arg))


def split_resume_dir(rest: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """``--resume RUN_DIR`` or ``--resume=RUN_DIR`` (a directory) -> (RUN_DIR, the other arguments); a bare
    ``--resume`` (or ``--resume`` before another flag or an override ``key=value``) stays the Megatron-LM style
    flag ``train.resume=true``, and ``--resume=WORD`` with a boolean word (``true``, ``false``, ``1``, ``0``,
    ...) is ``train.resume=WORD``. The word after ``--resume`` is RUN_DIR when it is an existing directory or
    does not look like an override (:func:`_is_run_dir_arg`), so a directory whose name holds ``=`` works."""
    rest = list(rest)
    for i, arg in enumerate(rest):
        if arg == "--resume" and i + 1 < len(rest) and _is_run_dir_arg(rest[i + 1]):
            return rest[i + 1], rest[:i] + rest[i + 2:]
        if arg.startswith("--resume="):
            value = arg[len("--resume="):]
            if value.lower() in _BOOLEAN_WORDS:
                rest[i] = f"train.resume={value}"
            elif value:
                return value, rest[:i] + rest[i + 1:]
    return None, rest


def check_resumed_architecture(parser: argparse.ArgumentParser, cfg: RunConfig) -> None:
    """A run resumed (or evaluated) from a checkpoint of another architecture is an error naming the field,
    the checkpoint's value and the new one, before anything is built; so is a broken ``checkpoints/latest``
    (reported as ``megatron-logra: error: ...`` for ``--resume RUN_DIR``, a bare ``--resume`` and
    ``train.resume=true`` alike)."""
    if not cfg.train.resume:
        return
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.checkpoint.compat import check_architecture

    def check() -> None:
        ckpt = latest_checkpoint(cfg.train.run_dir)
        if ckpt is not None:
            check_architecture(ckpt, cfg.model)

    reporting_user_errors(parser, check)


RESUME_LAUNCH_FIELDS = frozenset({
    "train.steps", "rl.steps",  # the run's length (checked against the checkpoint: check_resume_steps)
    "train.resume", "train.run_dir", "train.overwrite",
    "train.micro_batch_size", "rl.micro_batch_size",  # the split of a step into micro-batches (per layout)
    "rl.max_tokens_per_micro_batch",  # the same, by a token budget (0 where the new layout pipelines)
    "train.progress", "train.log_interval", "train.eval_interval", "rl.eval_interval",
    "train.save_interval", "train.keep_last", "train.checkpoint_checksums", "train.memory_check",
    "train.exit_signal_handler", "train.exit_duration_minutes",
    "rl.rollout.sglang_api_key", "rl.rollout.sglang_admin_api_key",  # redacted in the saved config
    "task.reward_workers",  # where rewards are scored: the same rewards in process or in workers
})
"""Dotted fields that ``train.resume=true`` with a recipe may set to other values than the run's saved config:
the run's length, where it runs and how it is launched, logged, evaluated, checkpointed and stopped, and the
credentials a saved config never holds. Every ``parallel.*`` field is one too (a checkpoint resumes at any
TP / PP / DP layout), and so is every ``profile.*`` field (profiling changes nothing the run computes: a resumed
run may profile other steps, or none). Any other field must keep the run's value (:func:`check_recipe_resume`)."""


def _is_launch_field(name: str) -> bool:
    return name in RESUME_LAUNCH_FIELDS or name.startswith(("parallel.", "profile."))


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping stays a value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_differences(saved: Mapping[str, Any], cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted field, saved value, value of cfg)`` for each field other than the launch settings
    (:data:`RESUME_LAUNCH_FIELDS`, ``parallel.*``, ``profile.*``) whose value in ``cfg`` (a ``RunConfig``,
    compared as it would be saved: credentials redacted, through YAML) differs from ``saved`` (a run's saved config, as
    :func:`~megatron_logra.checkpoint.run_dir.resume_config` reads it). A field only one of them has (a
    config saved by another version) is not compared. Sorted by field."""
    from megatron_logra.config import to_dict
    from megatron_logra.optim.schedule import ABSOLUTE_LRS
    from megatron_logra.rollout.sglang_setup import redact_config

    new = _flat(yaml.safe_load(yaml.safe_dump(redact_config(to_dict(cfg)), sort_keys=False)))
    old = _flat(saved)
    if isinstance(old.get("model.hf_path"), str) and old["model.hf_path"]:  # saved as given before it was absolute
        old["model.hf_path"] = os.path.abspath(old["model.hf_path"])
    peak = next(iter(cfg.optimizer.scheduled_lrs().values()), None)
    for name, ratio_name in ABSOLUTE_LRS.items():
        absolute, ratio = f"optimizer.schedule.{name}", f"optimizer.schedule.{ratio_name}"
        value = new.get(absolute)
        if absolute not in old and value is not None and new.get(ratio) == 0:
            # saved before the absolute field existed: its flag (--min-lr, --lr-warmup-init) was kept as the
            # ratio value / peak, which the same flag now gives as the absolute lr
            if peak and old.get(ratio) == value / peak:
                old[ratio] = 0.0
    return sorted((name, old[name], new[name]) for name in old.keys() & new.keys()
                  if not _is_launch_field(name) and old[name] != new[name])



def check_recipe_resume(cfg: RunConfig) -> None:
    """``train.resume=true`` (a bare ``--resume``) with a recipe or YAML file, before anything is built or written:

    * with ``train.overwrite=true`` too: ``ValueError`` (overwriting deletes the run to continue);
    * ``train.run_dir`` without a checkpoint: the run starts from step 0, as Megatron-LM's ``--load`` of a
      directory without a checkpoint does, with a warning (rank 0) naming the directory;
    * else the config must be the run's saved one (``RUN/config.yaml``, or the latest checkpoint's copy)
      except the launch settings (:func:`resume_differences`): ``ValueError`` listing each differing field
      with both values, naming ``--resume RUN_DIR [OVERRIDE ...]`` (which takes the saved config) and a new
      ``train.run_dir`` as the ways on. A broken checkpoint is a ``CheckpointError`` (a ``ValueError``)."""
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.checkpoint.run_dir import resume_config

    run_dir = Path(cfg.train.run_dir)
    if cfg.train.overwrite:
        raise ValueError(f"train.resume=true and train.overwrite=true: overwriting would delete the run in {run_dir} "
                         f"that resuming continues; drop train.overwrite=true to continue it, or drop train.resume "
                         f"to replace it")
    if latest_checkpoint(run_dir) is None:
        if is_rank0():
            logger.warning("train.resume=true: no checkpoint in %s (no complete checkpoints/latest); training starts "
                           "from step 0", run_dir)
        return
    differ = resume_differences(resume_config(run_dir), cfg)
    if differ:
        shown = "; ".join(f"{name}: {old!r} saved, {new!r} given" for name, old, new in differ[:12])
        more = f"; and {len(differ) - 12} more" if len(differ) > 12 else ""
        raise ValueError(f"train.resume=true continues the run in {run_dir}, but the recipe and overrides given "
                         f"differ from the config it was trained with ({run_dir / 'config.yaml'}): {shown}{more}. "
                         f"Continue it with its own config: megatron-logra train --resume {run_dir} [OVERRIDE ...] "
                         f"(e.g. train.steps=N; any TP/PP/DP), or start a new run in another train.run_dir "
                         f"(nothing was changed)")

