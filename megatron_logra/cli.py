"""``megatron-logra``: thin command-line entry point.

    megatron-logra train [RECIPE|file.yaml] [overrides...]     # default recipe: tiny (RL)
    megatron-logra train --resume RUN_DIR [overrides...]        # continue a run (its config.yaml; any TP/PP/DP)
    megatron-logra eval RUN_DIR [overrides...]                 # held-out accuracy of a run's latest checkpoint
    megatron-logra plot RUN_DIR [--out FILE]                   # PNG: reward/accuracy, KL, α, memory (lm: loss, ...)
    megatron-logra recipes                                     # list recipes
    megatron-logra config [RECIPE] [overrides...]              # print the resolved config
    megatron-logra memory --model 27b --tp 8 --compare         # per-GPU memory plan, dense AdamW vs LoGRA
    megatron-logra convert hf-to-mcore --hf DIR --out DIR [--tp N --pp M]    # HF -> per-rank megatron-core files
    megatron-logra convert mcore-to-hf --mcore DIR --out DIR [--hf-template DIR]   # and back (or a trainer checkpoint)
    megatron-logra bench paper [--quick]                       # small-scale paper figures -> docs/results.md
    megatron-logra train --help                                # override syntax and Megatron-LM flags (also eval, config)

Launch multi-process runs with torchrun, e.g.
``torchrun --nproc-per-node 4 -m megatron_logra.cli train --tensor-model-parallel-size 2``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

__all__ = ["main", "RESUME_LAUNCH_FIELDS", "resume_differences"]

logger = logging.getLogger("megatron_logra.cli")  # not __name__: ``python -m megatron_logra.cli`` is __main__

_COMMANDS = ("train", "eval", "plot", "config", "recipes", "memory", "convert", "bench")


def _launch_rank() -> int:
    """This process's ``RANK`` as a launcher set it; 0 when unset or not an integer (the job then refuses the
    launch with an error naming the variable: :func:`megatron_logra.parallel.launch_rank_and_world`)."""
    try:
        return int(os.environ.get("RANK", "").strip() or 0)
    except ValueError:
        return 0


def _setup_logging() -> None:
    rank = _launch_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # megatron-core warns at import and build time that TE/apex are absent (expected on CPU)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    # its Megatron-FSDP package announces itself at import (INFO); this trainer does not use FSDP
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)


_SYNOPSES = {
    "train": ("megatron-logra train [RECIPE | FILE.yaml] [OVERRIDE ...]\n"
              "       megatron-logra train --resume RUN_DIR [OVERRIDE ...]",
              "Train a recipe (default: tiny, the RL job; `megatron-logra recipes` lists them) or a YAML file (a "
              "partial config whose `recipe: NAME_OR_FILE` names its base), or continue the run in RUN_DIR from its "
              "latest checkpoint (its config.yaml, with the overrides on top; any TP/PP/DP layout). Launch "
              "multi-process runs with `torchrun --nproc-per-node N -m megatron_logra.cli train ...`."),
    "eval": ("megatron-logra eval RUN_DIR [OVERRIDE ...]",
             "Evaluate the latest checkpoint of RUN_DIR with its config.yaml (overrides on top): held-out accuracy "
             "(RL) or loss (lm), printed as JSON."),
    "config": ("megatron-logra config [RECIPE | FILE.yaml] [OVERRIDE ...]\n"
               "       megatron-logra config --resume RUN_DIR [OVERRIDE ...]",
               "Print the resolved config as YAML (default recipe: tiny): every field with its value, after the "
               "overrides (with model.hf_path, the checkpoint's architecture, as the RL job takes it). First it "
               "runs the checks of `train` that build nothing, each refusing what `train` refuses with the same "
               "error (exit status 2): the fields, the task (reasoning-gym names and task.dataset_kwargs, jsonl: "
               "files, a task.reward plugin's import), the tokenizer (tokenizer.path, or model.hf_path's "
               "config.json and tokenizer files; its size against model.vocab_size), the longest prompt against "
               "model.seq_length, and a resumed run's checkpoint (architecture, steps, saved config). Not "
               "checked: the TP/PP/DP layout against the launch's world size, the memory plan, SGLang's "
               "presence, train.run_dir's state, the model build, the weights and the KL probe."),
}
"""Subcommands that take a recipe and overrides: their synopsis and description (``-h`` / ``--help``)."""


def command_help(command: str) -> str:
    """Usage of ``train`` / ``eval`` / ``config``: synopsis, override syntax, Megatron-LM flags, fields."""
    import textwrap

    from megatron_logra.megatron_flags import (CHECK_FLAGS, IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, JOB_ALIASES,
                                               LOAD_FLAGS, MEGATRON_ALIASES, MEGATRON_FLAGS, NEUTRAL_FLAGS,
                                               OPTIMIZER_ALIASES, REFUSED_SWITCHES, REFUSED_VALUE_FLAGS,
                                               SCHEDULE_RATIO_FLAGS)

    def flags(names) -> str:
        return textwrap.fill(", ".join(f"--{n}" for n in names), width=100, initial_indent="    ",
                             subsequent_indent="    ", break_on_hyphens=False, break_long_words=False)

    synopsis, description = _SYNOPSES[command]
    return "\n".join([
        f"usage: {synopsis}",
        "",
        textwrap.fill(description, width=100, break_on_hyphens=False),
        "",
        "overrides (applied in order, then the whole config is validated; a bad value is an error naming the field):",
        "  key=value                   a dotted field: rl.steps=120  optimizer.logra.rank=8  task.datasets=chain_sum,gcd",
        "  --key value | --key=value   the same: --rl.group_size 4  --model.hf_path=/ckpt/Qwen2.5-1.5B",
        "  logra.* / native.*          short for optimizer.logra.* / optimizer.native.*",
        "  schedule.*                  short for optimizer.schedule.* (lr warmup and decay)",
        "  Megatron-LM flags           --tensor-model-parallel-size 2  --seq-length 128  --bf16 (below)",
        *(["  --resume [RUN_DIR]          with RUN_DIR (or --resume=RUN_DIR): continue that run from its latest",
           "                              checkpoint, with its config.yaml and the overrides on top (no RECIPE);",
           "                              bare (a switch, below): train.resume=true for the run in train.run_dir,",
           "                              whose saved config the recipe and overrides must give (launch settings",
           "                              aside: steps, TP/PP/DP, logging, checkpointing); no checkpoint: step 0"]
          if command in ("train", "config") else []),
        "",
        "Megatron-LM flags (each sets one field):",
        flags(MEGATRON_ALIASES),
        "  by job (rl.* for job=rl, train.* for job=lm; --global-batch-size: lm only):",
        flags(JOB_ALIASES),
        "  by optimizer (optimizer.native.* for optimizer.name=adam, else optimizer.logra.* / the non-target AdamW;",
        "  refused where the optimizer would not read them):",
        flags(OPTIMIZER_ALIASES),
        "  absolute lrs of the schedule of the peak lr that --lr sets (after every other override), kept as given:",
        "  --lr-warmup-init -> optimizer.schedule.warmup_init_lr, --min-lr -> optimizer.schedule.min_lr:",
        flags(SCHEDULE_RATIO_FLAGS),
        "  checks only (model.seq_length is --seq-length):",
        flags(CHECK_FLAGS),
        "  switches (no value):",
        flags(MEGATRON_FLAGS),
        *(f"  --{name} DIR: " + " ".join(f"{field}={'DIR' if value is None else value}" for field, value in fields)
          + " (a --save naming another directory is refused)" for name, fields in LOAD_FLAGS.items()),
        "  accepted and ignored, with a warning saying why (already in effect here):",
        flags([*IGNORED_SWITCHES, *IGNORED_VALUE_FLAGS]),
        "  accepted only at the value this trainer runs (--context-parallel-size 1, --ckpt-format torch_dist, ...):",
        flags(NEUTRAL_FLAGS),
        "  refused, naming what to use instead:",
        flags([*REFUSED_SWITCHES, *REFUSED_VALUE_FLAGS]),
        "",
        "fields:",
        "  megatron-logra config RECIPE [OVERRIDE ...]   every field of a recipe with its value (the resolved config)",
        "  megatron-logra recipes                        the recipes",
        "  Each field is documented in its dataclass (megatron_logra/config.py and the configs it composes).",
        "",
    ])


def _split_recipe(args: Sequence[str]) -> tuple[Optional[str], list[str]]:
    if args and not args[0].startswith("-") and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _Parser(prog="megatron-logra", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=_COMMANDS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="recipe name or YAML, then overrides")
    if not (sys.argv[1:] if argv is None else list(argv)):
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{parser.prog}: error: a command is required ({', '.join(_COMMANDS)}); "
                       f"`{parser.prog} --help` describes them\n")
    ns = parser.parse_args(argv)
    if ns.command in _SYNOPSES and any(arg in ("-h", "--help") for arg in ns.rest):
        sys.stdout.write(command_help(ns.command))
        return 0
    _setup_logging()
    if ns.command == "memory":
        from megatron_logra.memory.cli import main as memory_main

        return memory_main(ns.rest)
    if ns.command == "convert":
        from megatron_logra.convert.cli import main as convert_main

        return convert_main(ns.rest)
    if ns.command == "bench":
        from megatron_logra.bench.cli import main as bench_main

        return bench_main(ns.rest)

    from megatron_logra.config import RECIPES, to_dict
    from megatron_logra.overrides import parse_args_to_config

    if ns.command == "recipes":
        if ns.rest:
            parser.error(f"recipes takes no arguments (got {' '.join(ns.rest)!r}); it lists every recipe, and "
                         f"`{parser.prog} config RECIPE` prints one recipe's fields")
        for name, fn in RECIPES.items():
            sys.stdout.write(f"{name:12s} {fn.__doc__.strip().splitlines()[0]}\n")
        return 0
    if ns.command == "plot":
        from megatron_logra.plot import plot_run

        plot_parser = argparse.ArgumentParser(prog="megatron-logra plot")
        plot_parser.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
        plot_parser.add_argument("--out", help="image to write (default RUN_DIR/summary.png; .png is added "
                                               "when the name has no image suffix)")
        plot_args = plot_parser.parse_args(ns.rest)
        try:
            sys.stdout.write(f"{plot_run(plot_args.run_dir, plot_args.out)}\n")
        except (OSError, ValueError) as exc:
            _user_error(parser, exc)
        return 0
    if ns.command == "eval":
        return _eval(parser, ns.rest)
    resume_dir, rest = _resume_dir(ns.rest)
    try:
        if resume_dir is not None:
            cfg = _run_dir_config(parser, resume_dir, rest, command=ns.command)
        else:
            recipe, overrides = _split_recipe(rest)
            cfg = parse_args_to_config(recipe, overrides)
    except ValueError as exc:
        _user_error(parser, exc)
    _check_resumed_architecture(parser, cfg)
    if resume_dir is None and cfg.train.resume:
        _reporting_user_errors(parser, lambda: _check_recipe_resume(cfg))
    if ns.command == "config":
        import copy

        from megatron_logra.rollout.sglang_setup import redact_config

        # the job's own checks that build nothing (a copy: they may fill in what the job derives, as it does)
        _reporting_user_errors(parser, lambda: _job_check_config(copy.deepcopy(cfg)))
        sys.stdout.write(yaml.safe_dump(redact_config(to_dict(cfg)), sort_keys=False))  # output often goes to a file
        return 0

    from megatron_logra.parallel import destroy_parallel

    if cfg.job == "rl":
        from megatron_logra.rl.job import run_rl as run
    else:
        from megatron_logra.train.lm import run_lm as run
    succeeded = False
    try:
        summary = _reporting_user_errors(parser, lambda: run(cfg))
        succeeded = True
    finally:
        destroy_parallel(wait_for_peers=succeeded)
    if _is_rank0():
        from megatron_logra.metrics import strict_dumps

        sys.stdout.write(strict_dumps(summary, indent=1) + "\n")  # as summary.json: null for a non-finite value
    return 0


def _job_check_config(cfg) -> None:
    """What ``megatron-logra config`` checks beyond the config's own validation: the configured job's start-time
    checks that need no process group, model or GPU and write nothing (:func:`megatron_logra.rl.job.check_config`,
    :func:`megatron_logra.train.lm.check_config`), which ``train`` runs too."""
    if cfg.job == "rl":
        from megatron_logra.rl.job import check_config
    else:
        from megatron_logra.train.lm import check_config
    check_config(cfg)


USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
"""Errors that mean bad input (a config value, a path, a checkpoint -- ``CheckpointError`` is a
``ValueError``): reported as ``megatron-logra: error: ...`` with exit status 2, no traceback.
``MEGATRON_LOGRA_TRACEBACK=1`` re-raises them (for debugging)."""


def _tracebacks_wanted() -> bool:
    """``MEGATRON_LOGRA_TRACEBACK`` is set to something other than ``""`` / ``0``."""
    return os.environ.get("MEGATRON_LOGRA_TRACEBACK", "") not in ("", "0")


def _user_error(parser: argparse.ArgumentParser, exc: BaseException) -> typing.NoReturn:
    """Bad input ``exc`` -> ``megatron-logra: error: ...``, exit status 2; with ``MEGATRON_LOGRA_TRACEBACK=1``
    re-raised instead (call it in the ``except`` block that caught ``exc``)."""
    if _tracebacks_wanted():
        raise exc
    parser.error(str(exc))


def _reporting_user_errors(parser: argparse.ArgumentParser, fn):
    try:
        return fn()
    except USER_ERRORS as exc:
        if _tracebacks_wanted():
            raise
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


REPORT_GRACE_SECONDS = 10.0
"""How long a rank other than 0 of a multi-process launch waits, silent, before it reports an error that made it
stop (:func:`_exit_with_error`): rank 0 meets the same error and reports it, and the launcher (torchrun) stops
the other ranks as soon as one has failed."""


def _peer_rank() -> Optional[int]:
    """This process's rank when it is one of ranks 1..N-1 of a multi-process launch (``RANK`` and ``WORLD_SIZE``
    both integers, ``0 < RANK < WORLD_SIZE``); None for rank 0, for one process and for an inconsistent launch
    environment (which every rank reports itself: :func:`megatron_logra.parallel.launch_rank_and_world`)."""
    try:
        rank, world = int(os.environ.get("RANK", "").strip()), int(os.environ.get("WORLD_SIZE", "").strip())
    except ValueError:
        return None
    return rank if 0 < rank < world else None


def _exit_with_error(status: int, message: str) -> typing.NoReturn:
    """Write ``message`` (an error report, ending in a newline) to stderr and exit with ``status``, once per launch.

    Every rank of a multi-process launch parses the same command line and config, so a refused config or
    override fails on all of them alike: rank 0 (and a process without a launcher) reports it at once, and the
    other ranks wait silently for up to :data:`REPORT_GRACE_SECONDS` so that rank 0 reports it first. A launcher
    that stops the remaining ranks once one has failed (torchrun does, with SIGTERM) then ends them during that
    wait: they exit with the same ``status``, without a word. A rank still running after the wait (an error that
    rank 0 did not meet, e.g. a path missing on that rank's node only, or a launcher that stops nobody) reports
    its error itself; so do the ranks of another node when its torchrun learns of the failure only after the
    wait (the error then appears once per node)."""
    import signal
    import time

    if _peer_rank() is not None:
        def stopped(signum, frame) -> None:  # the launcher ends this rank: rank 0 has failed (and reported)
            os._exit(status)

        signal.signal(signal.SIGTERM, stopped)
        signal.signal(signal.SIGINT, stopped)
        time.sleep(REPORT_GRACE_SECONDS)
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.exit(status)


class _Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors (a bad argument, a refused config or override) are reported once
    per multi-process launch (:func:`_exit_with_error`)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.format_usage()}{self.prog}: error: {message}\n")

    def exit(self, status: int = 0, message: Optional[str] = None) -> typing.NoReturn:
        if status == 0 or not message:
            super().exit(status, message)
        _exit_with_error(status, message)


_BOOLEAN_WORDS = frozenset({"1", "0", "true", "false", "yes", "no", "on", "off"})
"""What a boolean field parses: ``--resume=true`` is ``train.resume=true``."""


_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*=")
"""The start of a ``key=value`` / ``a.b=value`` override (a path such as ``/runs/lr=0.1`` is not one)."""


def _is_run_dir_arg(arg: str) -> bool:
    """Whether ``arg``, the word after ``--resume``, is a run directory: not a flag, and an existing directory or
    anything that does not start like a dotted override (``/runs/lr=0.1/a`` is a directory, ``rl.steps=9`` an
    override of a bare ``--resume``)."""
    return not arg.startswith("-") and (os.path.isdir(arg) or not _OVERRIDE.match(arg))


def _resume_dir(rest: Sequence[str]) -> tuple[Optional[str], list[str]]:
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


def _check_resumed_architecture(parser: argparse.ArgumentParser, cfg) -> None:
    """A run resumed (or evaluated) from a checkpoint of another architecture is an error naming the field,
    the checkpoint's value and the new one, before anything is built; so is a broken ``checkpoints/latest``
    (reported as ``megatron-logra: error: ...`` for ``--resume RUN_DIR``, a bare ``--resume`` and
    ``train.resume=true`` alike)."""
    if not cfg.train.resume:
        return
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.checkpoint.store import check_architecture

    def check() -> None:
        ckpt = latest_checkpoint(cfg.train.run_dir)
        if ckpt is not None:
            check_architecture(ckpt, cfg.model)

    _reporting_user_errors(parser, check)


RESUME_LAUNCH_FIELDS = frozenset({
    "train.steps", "rl.steps",  # the run's length (checked against the checkpoint: check_resume_steps)
    "train.resume", "train.run_dir", "train.overwrite",
    "train.micro_batch_size", "rl.micro_batch_size",  # the split of a step into micro-batches (per layout)
    "train.progress", "train.log_interval", "train.eval_interval", "rl.eval_interval",
    "train.save_interval", "train.keep_last", "train.checkpoint_checksums", "train.memory_check",
    "train.exit_signal_handler", "train.exit_duration_minutes",
    "rl.rollout.sglang_api_key", "rl.rollout.sglang_admin_api_key",  # redacted in the saved config
})
"""Dotted fields that ``train.resume=true`` with a recipe may set to other values than the run's saved config:
the run's length, where it runs and how it is launched, logged, evaluated, checkpointed and stopped, and the
credentials a saved config never holds. Every ``parallel.*`` field is one too (a checkpoint resumes at any
TP / PP / DP layout). Any other field must keep the run's value (:func:`_check_recipe_resume`)."""


def _is_launch_field(name: str) -> bool:
    return name in RESUME_LAUNCH_FIELDS or name.startswith("parallel.")


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping stays a value)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_differences(saved: Mapping[str, Any], cfg) -> list[tuple[str, Any, Any]]:
    """``(dotted field, saved value, value of cfg)`` for each field other than the launch settings
    (:data:`RESUME_LAUNCH_FIELDS`, ``parallel.*``) whose value in ``cfg`` (a ``RunConfig``, compared as it
    would be saved: credentials redacted, through YAML) differs from ``saved`` (a run's saved config, as
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


def _is_rank0() -> bool:
    return _launch_rank() == 0


def _check_recipe_resume(cfg) -> None:
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
        if _is_rank0():
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


def _launch_world_size() -> int:
    """The number of processes this launch runs (as :func:`megatron_logra.parallel.init_distributed` will see it):
    the process group's when one exists, else torchrun's ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def _check_saved_layout(cfg, saved: Mapping[str, Any], cfg_path: Path, named: str) -> None:
    """``ValueError`` when ``cfg``'s TP × PP does not divide this launch's world size, naming the values that came
    from ``cfg_path`` (a run saved at another layout) and the overrides that fit this launch."""
    tp, pp, world = cfg.parallel.tp, cfg.parallel.pp, _launch_world_size()
    if world % (tp * pp) == 0:
        return
    saved_parallel = saved.get("parallel") if isinstance(saved.get("parallel"), Mapping) else {}
    origins = [f"parallel.{name}={value} ({'from ' + str(cfg_path) if saved_parallel.get(name) == value else 'given'})"
               for name, value in (("tp", tp), ("pp", pp)) if value > 1]
    flags = [flag for flag, value in (("--tensor-model-parallel-size 1", tp), ("--pipeline-model-parallel-size 1", pp))
             if value > 1]
    dotted = [f"parallel.{name}=1" for name, value in (("tp", tp), ("pp", pp)) if value > 1]
    launch = "this one process (no torchrun)" if world == 1 else f"{world} processes"
    raise ValueError(f"{' and '.join(origins)}: tp × pp = {tp * pp} does not divide the world size {world} of "
                     f"{launch}. {named} works at any TP / PP / DP layout: add {' '.join(flags)} (or "
                     f"{' '.join(dotted)}), or launch a multiple of {tp * pp} processes "
                     f"(torchrun --nproc-per-node {tp * pp} -m megatron_logra.cli ...)")


def _run_dir_config(parser: argparse.ArgumentParser, run_dir, overrides: list[str], *, command: str = "train",
                    progress: Optional[bool] = None):
    """The config saved in ``RUN_DIR/config.yaml`` (checked against the latest checkpoint's copy:
    :func:`~megatron_logra.checkpoint.run_dir.resume_config`), set to resume from its latest checkpoint, with
    ``overrides`` (e.g. more steps, another parallel layout) applied on top. ``command`` is what reads it:
    ``train`` / ``config`` (``--resume RUN_DIR``) or ``eval`` (``eval RUN_DIR``); errors name that form.
    Bad input is a ``ValueError`` naming it (the caller reports it with :func:`_user_error`): ``config.yaml``
    for the config, the broken file itself for a damaged checkpoint (``CheckpointError``, e.g. a corrupt
    ``meta.json``); ``train.overwrite=true`` (it would delete the run); ``train.run_dir`` naming another
    directory (the same one spelled otherwise is fine); and, for ``train`` and ``eval``, a saved TP × PP that
    does not divide this launch's world size (naming the overrides that fit it)."""
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.checkpoint.integrity import CheckpointError
    from megatron_logra.checkpoint.run_dir import resume_config
    from megatron_logra.config import RunConfig, from_dict
    from megatron_logra.overrides import apply_overrides

    evaluating = command == "eval"
    run_dir = Path(run_dir)
    named = f"eval {run_dir}" if evaluating else f"--resume {run_dir}"
    cfg_path = run_dir / "config.yaml"
    has_checkpoint = latest_checkpoint(run_dir) is not None
    if not cfg_path.exists() and not has_checkpoint:
        raise ValueError(f"{cfg_path} does not exist: is {run_dir} a run directory?")
    if not has_checkpoint:
        raise ValueError(f"{run_dir} has no checkpoint (no complete checkpoints/latest) to "
                         f"{'evaluate' if evaluating else 'continue from'}")
    if overrides and not overrides[0].startswith("-") and "=" not in overrides[0]:
        raise ValueError(f"{named} takes its recipe from {cfg_path}; drop {overrides[0]!r}"
                         f"{'' if evaluating else ' or start a new run'}")
    # config.yaml, or the latest checkpoint's copy when config.yaml is missing or cut short; a broken checkpoint
    # (CheckpointError: its meta.json, a shard, checkpoints/latest) names its own file and keeps its message
    try:
        saved = resume_config(run_dir)
    except CheckpointError:
        raise
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
    try:
        cfg = apply_overrides(cfg, overrides)
    except ValueError as exc:
        raise ValueError(f"{cfg_path}{' with the overrides given' if overrides else ''}: {exc}") from exc
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
    if command != "config":
        _check_saved_layout(cfg, saved, cfg_path, named)
    return cfg


def _eval(parser: argparse.ArgumentParser, rest: Sequence[str]) -> int:
    from megatron_logra.parallel import destroy_parallel

    if not rest:
        parser.error("eval needs a run directory")
    run_dir = Path(rest[0])
    try:
        cfg = _run_dir_config(parser, run_dir, list(rest[1:]), command="eval", progress=False)
        if cfg.job == "rl" and cfg.task.num_eval == 0:
            raise ValueError(f"task.num_eval=0: {run_dir} has no held-out set to evaluate; give task.num_eval=N "
                             f"(e.g. task.num_eval=200) to evaluate the run on N held-out problems")
    except ValueError as exc:
        _user_error(parser, exc)
    _check_resumed_architecture(parser, cfg)

    def evaluate() -> dict:
        if cfg.job == "rl":
            from megatron_logra.rl.job import build_components
            from megatron_logra.rl.loop import evaluate_accuracy

            comps, state, _ = build_components(cfg, for_eval=True)
            return {"run_dir": str(run_dir), "step": state.step, "eval_accuracy": evaluate_accuracy(comps),
                    "num_eval": len(comps.task.eval_problems())}
        from megatron_logra.train.lm import evaluate_checkpoint

        return evaluate_checkpoint(cfg)

    succeeded = False
    try:
        result = _reporting_user_errors(parser, evaluate)
        succeeded = True
    finally:
        destroy_parallel(wait_for_peers=succeeded)
    if _is_rank0():
        from megatron_logra.metrics import strict_dumps

        sys.stdout.write(strict_dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
