"""``megatron-logra``: thin command-line entry point.

    megatron-logra train [RECIPE|file.yaml] [overrides...]     # default recipe: tiny (RL)
    megatron-logra train --resume RUN_DIR [overrides...]        # continue a run (its config.yaml; any TP/PP/DP)
    megatron-logra eval RUN_DIR [--ckpt-step N] [overrides...] # held-out accuracy of a run's latest checkpoint
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

# The package, by concern: usage (the commands and their --help), errors (bad input reported once per launch,
# exit status 2), launch (rank, world size, logging), resume (the --resume forms and checks), run_dir (a saved
# run's config), train (the train and config commands), evaluate (the eval command). main dispatches.

import argparse
import sys
from typing import Optional, Sequence

from megatron_logra.cli.errors import USER_ERRORS, Parser, user_error
from megatron_logra.cli.evaluate import run_eval
from megatron_logra.cli.launch import setup_logging
from megatron_logra.cli.resume import RESUME_LAUNCH_FIELDS, resume_differences
from megatron_logra.cli.train import run_train_or_config
from megatron_logra.cli.usage import COMMANDS, SYNOPSES, command_help

__all__ = ["main", "RESUME_LAUNCH_FIELDS", "USER_ERRORS", "command_help", "resume_differences"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``megatron-logra COMMAND ...`` with ``argv`` (default: ``sys.argv[1:]``) and return its exit status (0).

    Usage errors and bad input exit with status 2 and a one-line ``megatron-logra: error: ...`` report (once per
    multi-process launch: :mod:`megatron_logra.cli.errors`); ``-h`` / ``--help`` after ``train``, ``eval`` or
    ``config`` prints that command's usage. ``memory``, ``convert`` and ``bench`` are handed their arguments."""
    parser = Parser(prog="megatron-logra", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="recipe name or YAML, then overrides")
    if not (sys.argv[1:] if argv is None else list(argv)):
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{parser.prog}: error: a command is required ({', '.join(COMMANDS)}); "
                       f"`{parser.prog} --help` describes them\n")
    ns = parser.parse_args(argv)
    if ns.command in SYNOPSES and any(arg in ("-h", "--help") for arg in ns.rest):
        sys.stdout.write(command_help(ns.command))
        return 0
    setup_logging()
    if ns.command == "memory":
        from megatron_logra.memory.cli import main as memory_main

        return memory_main(ns.rest)
    if ns.command == "convert":
        from megatron_logra.convert.cli import main as convert_main

        return convert_main(ns.rest)
    if ns.command == "bench":
        from megatron_logra.bench.cli import main as bench_main

        return bench_main(ns.rest)

    from megatron_logra.config import RECIPES

    if ns.command == "recipes":
        if ns.rest:
            parser.error(f"recipes takes no arguments (got {' '.join(ns.rest)!r}); it lists every recipe, and "
                         f"`{parser.prog} config RECIPE` prints one recipe's fields")
        for name, fn in RECIPES.items():
            sys.stdout.write(f"{name:12s} {fn.__doc__.strip().splitlines()[0]}\n")
        return 0
    if ns.command == "plot":
        return _plot(parser, ns.rest)
    if ns.command == "eval":
        return run_eval(parser, ns.rest)
    return run_train_or_config(parser, ns.command, ns.rest)


def _plot(parser: argparse.ArgumentParser, rest: Sequence[str]) -> int:
    """``megatron-logra plot RUN_DIR [--out FILE]``: write the run's summary figure, print its path."""
    from megatron_logra.plot import plot_run

    plot_parser = argparse.ArgumentParser(prog="megatron-logra plot")
    plot_parser.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    plot_parser.add_argument("--out", help="image to write (default RUN_DIR/summary.png; a folder: "
                                           "FOLDER/summary.png; .png is added when the name has no image suffix)")
    plot_args = plot_parser.parse_args(rest)
    try:
        sys.stdout.write(f"{plot_run(plot_args.run_dir, plot_args.out)}\n")
    except OSError as exc:
        user_error(parser, _figure_write_error(exc, plot_args.run_dir, plot_args.out) or exc)
    except ValueError as exc:
        user_error(parser, exc)
    return 0


def _figure_write_error(exc: OSError, run_dir: str, out: Optional[str]) -> Optional[OSError]:
    """``exc`` restated as a failure to write the figure (naming the path, the OS's reason and ``--out``) when
    it was raised for the figure's path or a folder above it; None for any other error (reading the run)."""
    import os
    from pathlib import Path

    if not exc.filename or not exc.strerror:
        return None
    figure = os.path.abspath(Path(out) if out else Path(run_dir) / "summary.png")
    failed = os.path.abspath(exc.filename)
    if not (figure == failed or figure.startswith(failed.rstrip(os.sep) + os.sep) or failed.startswith(figure)):
        return None
    reason = exc.strerror
    if failed != figure and os.path.exists(failed) and not os.path.isdir(failed):
        reason = f"{exc.filename} is a file, not a folder"
    hint = "choose another --out" if out else "give --out FILE to write it elsewhere"
    return type(exc)(f"cannot write the figure to {out or figure}: {reason}; {hint}")
