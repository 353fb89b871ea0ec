"""A saved run's config, for the commands that name its directory: ``train --resume RUN_DIR`` (and ``config
--resume RUN_DIR``), which continue the run, and ``eval RUN_DIR``, which evaluates its latest checkpoint.

:func:`run_dir_config` reads ``RUN_DIR/config.yaml`` (or the latest checkpoint's copy), applies the overrides
given on top and refuses, as a ``ValueError`` naming the form used, what that form cannot do.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import yaml

from megatron_logra.cli.launch import launch_world_size

if TYPE_CHECKING:
    from megatron_logra.config import RunConfig

__all__ = ["check_saved_layout", "run_dir_config"]

logger = logging.getLogger(__name__)


def check_saved_layout(cfg: RunConfig, saved: Mapping[str, Any], cfg_path: Path, named: str,
                       adapt: bool = False) -> None:
    """``ValueError`` when ``cfg``'s TP × PP does not divide this launch's world size, naming the values that came
    from ``cfg_path`` (a run saved at another layout) and the overrides that fit this launch.

    ``adapt`` (evaluation, which writes nothing and can read the checkpoint at any layout): saved values
    that do not fit are lowered to the largest divisors of their own that do (``gcd``; one process: TP = PP
    = 1), with an info line; values given on the command line are never changed."""
    tp, pp, world = cfg.parallel.tp, cfg.parallel.pp, launch_world_size()
    if world % (tp * pp) == 0:
        return
    saved_parallel = saved.get("parallel") if isinstance(saved.get("parallel"), Mapping) else {}
    if adapt and all(saved_parallel.get(name) == value for name, value in (("tp", tp), ("pp", pp)) if value > 1):
        new_tp = math.gcd(tp, world)
        new_pp = math.gcd(pp, world // new_tp)
        logger.info("%s: the run's layout tp=%d × pp=%d does not fit %d process(es); evaluating at tp=%d × pp=%d "
                    "(set parallel.tp / parallel.pp to choose)", named, tp, pp, world, new_tp, new_pp)
        cfg.parallel.tp, cfg.parallel.pp = new_tp, new_pp
        return
    sizes = [(name, value, saved_parallel.get(name) == value) for name, value in (("tp", tp), ("pp", pp)) if value > 1]
    origins = [f"parallel.{name}={value} ({'from ' + str(cfg_path) if saved else 'given'})"
               for name, value, saved in sizes]
    # the sizes given on the command line stay when lowering the saved ones alone fits this launch
    keep_given = world % math.prod(value for _, value, saved in sizes if not saved) == 0
    lowered = [name for name, _, saved in sizes if saved or not keep_given]
    flags = [f"--{'tensor' if name == 'tp' else 'pipeline'}-model-parallel-size 1" for name in lowered]
    dotted = [f"parallel.{name}=1" for name in lowered]
    launch = "this one process (no torchrun)" if world == 1 else f"{world} processes"
    raise ValueError(f"{' and '.join(origins)}: tp × pp = {tp * pp} does not divide the world size {world} of "
                     f"{launch}. {named} works at any TP / PP / DP layout: add {' '.join(flags)} (or "
                     f"{' '.join(dotted)}), or launch a multiple of {tp * pp} processes "
                     f"(torchrun --nproc-per-node {tp * pp} -m megatron_logra.cli ...)")


def run_dir_config(run_dir: Union[str, Path], overrides: list[str], *, command: str = "train",
                   progress: Optional[bool] = None) -> RunConfig:
    """The config saved in ``RUN_DIR/config.yaml`` (checked against the latest checkpoint's copy:
    :func:`~megatron_logra.checkpoint.run_dir.resume_config`), set to resume from its latest checkpoint, with
    ``overrides`` (e.g. more steps, another parallel layout) applied on top. ``command`` is what reads it:
    ``train`` / ``config`` (``--resume RUN_DIR``) or ``eval`` (``eval RUN_DIR``); errors name that form.
    Bad input is a ``ValueError`` naming it (the caller reports it with :func:`~megatron_logra.cli.errors.user_error`):
    ``config.yaml`` for the config, the broken file itself for a damaged checkpoint (``CheckpointError``, e.g. a
    corrupt ``meta.json``); ``train.overwrite=true`` (it would delete the run); ``train.run_dir`` naming another
    directory (the same one spelled otherwise is fine); and, for ``train``, a saved TP × PP that does not
    divide this launch's world size (naming the overrides that fit it; ``eval`` lowers a saved layout to one
    that fits, and refuses only one given on its command line)."""
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.checkpoint.integrity import CheckpointError
    from megatron_logra.checkpoint.run_dir import resume_config
    from megatron_logra.config import RunConfig, from_dict
    from megatron_logra.config import apply_overrides

    evaluating = command == "eval"
    run_dir = Path(run_dir)
    named = f"eval {run_dir}" if evaluating else f"--resume {run_dir}"
    cfg_path = run_dir / "config.yaml"
    has_checkpoint = latest_checkpoint(run_dir) is not None
    if not cfg_path.exists() and not has_checkpoint:
        raise ValueError(f"{cfg_path} does not exist: is {run_dir} a run directory?")
    if not has_checkpoint:
        from megatron_logra.checkpoint.run_dir import restart_command

        restart = "" if evaluating else f": the run {restart_command(run_dir)}"
        raise ValueError(f"{run_dir} has no checkpoint (no complete checkpoints/latest) to "
                         f"{'evaluate' if evaluating else 'continue from'}{restart}")
    if overrides and not overrides[0].startswith("-") and "=" not in overrides[0]:
        raise ValueError(f"{named} takes its recipe from {cfg_path}; drop {overrides[0]!r}"
                         f"{'' if evaluating else ' or start a new run'}")
    _check_config_keys(cfg_path, named)
    # config.yaml, or the latest checkpoint's copy when config.yaml is missing or cut short; a broken checkpoint
    # (CheckpointError: its meta.json, a shard, checkpoints/latest) names its own file and keeps its message
    try:
        saved = resume_config(run_dir)
    except CheckpointError as exc:
        raise _with_earlier_hint(exc, run_dir) from exc
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(str(exc) if str(exc).startswith(f"{cfg_path}:") else f"{cfg_path}: {exc}") from exc
    # the saved values are type-checked here but validated once, after the overrides: an override can then fix
    # a saved value that a check of this machine or version refuses (model.transformer_impl=local for a run
    # trained with transformer_engine, on a machine without it)
    try:
        cfg = from_dict(RunConfig, saved, validate=False)
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: {exc}") from exc
    # the first launch's train.overwrite=true is saved with the run: it never applies to a resume
    cfg.train.run_dir, cfg.train.resume, cfg.train.overwrite = str(run_dir), True, False
    if progress is not None:
        cfg.train.progress = progress
    saved_cfg = copy.deepcopy(cfg) if evaluating else None
    saved_tokenizer = copy.deepcopy(cfg.tokenizer)
    hf_path = cfg.model.hf_path if cfg.job == "rl" else ""
    try:
        cfg = apply_overrides(cfg, overrides)
    except ValueError as exc:
        if hf_path and not Path(hf_path).is_dir() and f"model.hf_path={hf_path!r}" in str(exc):
            # a job moved to another machine or cluster: the saved checkpoint path is not there
            raise ValueError(f"{cfg_path}: model.hf_path={hf_path!r}, the Hugging Face checkpoint the run started "
                             f"from, is not there (moved, or not on this machine); {named} reads it again (its "
                             f"architecture and stop tokens, the KL reference's weights): give its location with "
                             f"model.hf_path=DIR") from exc
        raise ValueError(f"{cfg_path}{' with the overrides given' if overrides else ''}: {exc}") from exc
    _check_saved_tokenizer(cfg, saved_tokenizer, run_dir, named)
    if Path(cfg.train.run_dir).resolve() != run_dir.resolve():
        if evaluating:
            raise ValueError(f"{named} evaluates the run in {run_dir}, but train.run_dir={cfg.train.run_dir!r} was "
                             f"also given; drop train.run_dir")
        raise ValueError(f"{named} continues the run in {run_dir}, but train.run_dir={cfg.train.run_dir!r} "
                         f"was also given; drop train.run_dir (or start a new run there without --resume)")
    cfg.train.run_dir = str(run_dir)
    if cfg.train.overwrite:
        if evaluating:
            raise ValueError(f"train.overwrite=true with {named}: evaluation never writes into the run; drop "
                             f"train.overwrite=true")
        raise ValueError(f"train.overwrite=true with {named}: overwriting would delete the run that --resume "
                         f"continues; drop train.overwrite=true to continue it, or start a new run (without "
                         f"--resume) to replace it")
    if evaluating:  # the saved config as read here: its checkpoint where model.hf_path says it is now
        saved_cfg.model.hf_path = cfg.model.hf_path
        _check_eval_optimizer(cfg, apply_overrides(saved_cfg, []), named)
    if command != "config":
        check_saved_layout(cfg, saved, cfg_path, named, adapt=evaluating)
    return cfg


def _check_saved_tokenizer(cfg: RunConfig, saved: Any, run_dir: Path, named: str) -> None:
    """``ValueError`` when an override changed ``tokenizer.*`` of an RL run that has its own ``RUN/tokenizer``:
    a resumed or evaluated run always reads that one (its checkpoints were trained on its token ids), so the
    override would be ignored while ``config.yaml`` recorded it as the run's tokenizer. A run whose
    ``RUN/tokenizer`` is missing takes ``tokenizer.*`` (with a warning), so the overrides stay allowed there."""
    from megatron_logra.config.codec import to_dict
    from megatron_logra.config.recipe_files import _flatten

    if cfg.job != "rl" or not (run_dir / "tokenizer").is_dir():
        return
    given, kept = (dict(_flatten({"tokenizer": to_dict(t)})) for t in (cfg.tokenizer, saved))
    changed = sorted(key for key, value in given.items() if kept.get(key) != value)
    if changed:
        shown = ", ".join(f"{key}={given[key]!r} (saved: {kept.get(key)!r})" for key in changed)
        raise ValueError(f"{named} reads the run's own tokenizer {run_dir / 'tokenizer'} (its checkpoints were "
                         f"trained on its token ids), but the overrides change {shown}: drop them (or start a new "
                         f"run to train with another tokenizer)")


def _check_eval_optimizer(cfg: RunConfig, saved: RunConfig, named: str) -> None:
    """``ValueError`` when an override changed ``optimizer.*`` for ``eval`` (``saved``: the run's config as
    saved, validated the same way): evaluation reads the run's weights with the optimizer state saved beside
    them, so the saved optimizer settings are the only ones that load, and no other one would change what is
    evaluated."""
    from megatron_logra.config.codec import to_dict
    from megatron_logra.config.recipe_files import _flatten

    given, kept = (dict(_flatten({"optimizer": to_dict(c.optimizer)})) for c in (cfg, saved))
    changed = sorted(key for key, value in given.items() if kept.get(key) != value)
    if changed:
        raise ValueError(f"{named} evaluates the run's saved weights; optimizer settings do not apply to it, "
                         f"but the overrides change {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}: "
                         f"drop them")


def _check_config_keys(cfg_path: Path, named: str) -> None:
    """``ValueError`` when ``config.yaml`` holds a key that is no config field (``rl.stepz``): a hand edit (a file
    cut short loses keys or fails to parse, but never gains one). Without this check, the field the edit
    misspelt reads as missing, the whole file as cut short, and the run silently resumes with the checkpoint's
    copy of the config, dropping every edit. An unreadable file is left to
    :func:`~megatron_logra.checkpoint.run_dir.resume_config`."""
    import dataclasses
    import difflib
    import typing

    from megatron_logra.config import RunConfig
    from megatron_logra.config.codec import _is_section, _section_type
    from megatron_logra.yaml_unique import safe_load_unique

    try:
        data = safe_load_unique(cfg_path.read_text())
    except Exception:  # missing, unreadable, not YAML, a repeated key: resume_config reports or falls back
        return
    if not isinstance(data, dict):
        return
    unknown: list[str] = []

    def walk(section: dict, cls: Any, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        for key, value in section.items():
            name = f"{prefix}{key}"
            if not isinstance(key, str) or key not in fields:
                close = difflib.get_close_matches(str(key), sorted(fields), n=1)
                unknown.append(f"{name!r}" + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
            elif isinstance(value, dict) and _is_section(hints[key]):
                walk(value, _section_type(hints[key]), f"{name}.")

    walk(data, RunConfig, "")
    if unknown:
        raise ValueError(f"{cfg_path} holds {'a key' if len(unknown) == 1 else 'keys'} that no config field has: "
                         f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}; {named} reads "
                         f"this file: fix or remove {'it' if len(unknown) == 1 else 'them'}")


def _with_earlier_hint(exc: Exception, run_dir: Path) -> Exception:
    """``exc`` (a ``CheckpointError`` met reading the latest checkpoint's ``meta.json``) with the newest earlier
    checkpoint to continue from appended, as the other checks of a damaged checkpoint name it; unchanged when
    its message already says what to do."""
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.checkpoint.catalog import earlier_checkpoint_hint
    from megatron_logra.checkpoint.integrity import CheckpointError

    message = str(exc)
    if "checkpoint there is" in message or "no earlier checkpoint" in message:
        return exc
    try:
        broken = latest_checkpoint(run_dir)
    except (CheckpointError, OSError):
        return exc
    if broken is None:
        return exc
    return CheckpointError(f"{message}; {earlier_checkpoint_hint(broken.parent, broken)}")
