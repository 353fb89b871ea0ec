"""``megatron-logra bench paper [--quick]``: regenerate the paper's evidence at small scale.

    megatron-logra bench paper --quick     # ≈3 min on 2 cores: 1 seed, 20 updates, small sizes
    megatron-logra bench paper             # ≈20 min: 3 seeds, 50 updates, hidden up to 768

Runs Fig 1 (memory), Fig 2 + 5a (accuracy per optimizer and per rank), Fig 5b/5c
(reconstruction cosines) and Fig 6 (KL handling) one after the other in this process and
writes ``docs/results.md`` (quick: ``docs/results-quick.md``) with PNGs under ``docs/results/``.
A run of some figures (``--figures``) or with other settings (``--optimizers``, ``--seeds``, ``--kl-modes``,
``--rl-steps``) writes a report named after them instead, each setting that differs from the preset as
``NAME_VALUES`` and then the figures, e.g. ``results-cosine.md``, ``results-seeds_1_2.md`` or
``results-quick-rl-steps_10-optimizers_logra_adam-memory.md`` (PNGs prefixed alike), so it replaces neither the
full report nor the report of a run with other settings; ``--render-only`` with the same flags re-renders that
one (a JSON under that name holding the run of other settings is refused naming the command that wrote it);
the report of a run made when every run with other settings was named ``results[-quick]-custom[-FIGURE...]``
is found under that older name, and re-rendered under the current one if it recorded the run of these flags.
The header records the command and the machine. A missing GaLore/APOLLO package is reported and skipped, never
fatal. A bad flag (a repeated seed or optimizer, ``--rl-steps 0``, an ``--out-dir`` or ``--run-root`` that
cannot be written, ...) ends with one ``error:`` line naming it before anything runs, exit status 2. A results
JSON that ``--render-only`` cannot use (missing, unreadable, not JSON, not a report's numbers) ends with
``megatron-logra bench paper: error: ...`` naming the file and the problem, exit status 2
(``MEGATRON_LOGRA_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from megatron_logra.bench.config import KL_MODES, OPTIMIZERS, PaperBenchConfig
from megatron_logra.bench.paper_run import run_paper
from megatron_logra.bench.rerender import render_only
from megatron_logra.bench.results_file import ResultsFileError

logger = logging.getLogger(__name__)

__all__ = ["add_parser", "build_parser", "config_from_args", "main", "unwritable_paths"]

PROG = "megatron-logra bench paper"
"""The command's name in its error messages (as argparse names it for the ``paper`` sub-command)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``paper`` sub-command to ``subparsers`` (of ``megatron-logra bench``)."""
    p = subparsers.add_parser("paper", help="small-scale paper figures vs GaLore and APOLLO",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="≈3 min budget: fewer steps, one seed, small sizes")
    p.add_argument("--out-dir", default="docs",
                   help="results.md (--quick: results-quick.md) goes here, PNGs and the JSON under OUT_DIR/results/; "
                        "a run of some --figures or with other settings writes a report named after them instead: "
                        "results[-quick][-SETTING_VALUES...][-FIGURE...].md, e.g. results-seeds_1_2-accuracy.md "
                        "(default docs)")
    p.add_argument("--run-root", default="runs/bench-paper", help="parent of the RL run directories (default runs/bench-paper)")
    p.add_argument("--figures", nargs="+", choices=["memory", "accuracy", "cosine", "kl"],
                   help="only these figure groups (default: all)")
    p.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), help="subset of optimizers (default: all)")
    p.add_argument("--kl-modes", nargs="+", choices=list(KL_MODES), help="subset of KL variants (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, help="training seeds of Fig 2 (default 1 2 3; --quick: 1)")
    p.add_argument("--rl-steps", type=int, help="RL updates per run (default 50; --quick: 20)")
    p.add_argument("--render-only", action="store_true",
                   help="re-render the report of these flags (results.md, results-quick.md, results-cosine.md, ...) "
                        "from its JSON under OUT_DIR/results/ without running anything")
    p.set_defaults(bench_command="paper")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``megatron-logra bench``, with its sub-commands (``paper``)."""
    parser = argparse.ArgumentParser(prog="megatron-logra bench", description="benchmarks that write reports")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_parser(sub)
    return parser


_USED_BY = {"seeds": ("accuracy",), "optimizers": ("memory", "accuracy"), "kl_modes": ("kl",),
            "rl_steps": ("accuracy", "kl")}
"""The figure groups that read each setting flag: one given while none of them runs is refused (it would change
nothing but the report's name)."""


def config_from_args(args: argparse.Namespace) -> PaperBenchConfig:
    """``PaperBenchConfig.preset(args.quick)`` with the flags given on top (ValueError names a bad field, or a
    setting flag that none of the selected ``--figures`` reads)."""
    figures = set(getattr(args, "figures", None) or ("memory", "accuracy", "cosine", "kl"))
    for name, users in _USED_BY.items():
        if getattr(args, name, None) is not None and not figures & set(users):
            raise ValueError(f"{_FLAGS[name]} is read only by the {' and '.join(users)} figure"
                             f"{'s' if len(users) > 1 else ''}, and --figures {' '.join(sorted(figures))} runs "
                             f"none of them: drop {_FLAGS[name]} or add {' or '.join(users)} to --figures")
    overrides: dict[str, Any] = {"out_dir": args.out_dir, "run_root": args.run_root}
    for flag, name in (("figures", "figures"), ("optimizers", "optimizers"), ("kl_modes", "kl_modes"),
                       ("seeds", "seeds"), ("rl_steps", "rl_steps")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[name] = value
    if args.rl_steps is not None and args.rl_steps < PaperBenchConfig.preset(args.quick).eval_interval:
        overrides["eval_interval"] = args.rl_steps
    return PaperBenchConfig.preset(args.quick, **overrides)


_FLAGS = {"figures": "--figures", "optimizers": "--optimizers", "kl_modes": "--kl-modes", "seeds": "--seeds",
          "rl_steps": "--rl-steps", "out_dir": "--out-dir", "run_root": "--run-root"}
"""Fields of :class:`PaperBenchConfig` that a flag sets, so that an error about one names the flag."""


def _flag_message(message: str) -> str:
    """``message`` of a config ``ValueError`` (``seeds=[1, 1] names ...``) starting with the flag of its field."""
    field_name = message.split("=", 1)[0]
    return f"{_FLAGS[field_name]}: {message}" if "=" in message and field_name in _FLAGS else message


def unwritable_paths(cfg: PaperBenchConfig, *, render_only: bool = False) -> Optional[str]:
    """Why the run of ``cfg`` could not write its output, naming the flag, or None: the report
    ``OUT_DIR/STEM.md`` and ``OUT_DIR/results/`` (its JSON and PNGs), and, when RL runs (the accuracy or
    KL figures, not ``render_only``), ``RUN_ROOT``. Checked before anything runs, so that a run is not
    lost at its end (:func:`~megatron_logra.bench.outputs.why_unwritable`; nothing is created)."""
    from megatron_logra.bench.outputs import why_unwritable
    from megatron_logra.bench.report_names import report_stem

    out = Path(cfg.out_dir)
    checks = [("--out-dir", why_unwritable(out / f"{report_stem(cfg)}.md")),
              ("--out-dir", why_unwritable(out / "results", directory=True))]
    if not render_only and {"accuracy", "kl"} & set(cfg.figures):
        checks.append(("--run-root", why_unwritable(cfg.run_root, directory=True)))
    return next((f"{flag}: {problem}" for flag, problem in checks if problem), None)


def _fail(message: str) -> int:
    """Report bad input in one line, as the other commands do, and return exit status 2."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 2


def main(args: Union[argparse.Namespace, Sequence[str], None] = None) -> int:
    """Entry point of ``megatron-logra bench ...``: parsed args or an argv list; returns the exit code."""
    parser = build_parser()
    ns = args if isinstance(args, argparse.Namespace) else parser.parse_args(list(args or []))
    try:
        cfg = config_from_args(ns)
    except ValueError as exc:
        return _fail(_flag_message(str(exc)))
    problem = unwritable_paths(cfg, render_only=getattr(ns, "render_only", False))
    if problem:
        return _fail(problem)
    if getattr(ns, "render_only", False):
        try:
            return render_only(Path(ns.out_dir), quick=ns.quick, cfg=cfg)
        except ResultsFileError as exc:  # bad input: one line, as the other commands report it
            if os.environ.get("MEGATRON_LOGRA_TRACEBACK", "") not in ("", "0"):
                raise
            return _fail(str(exc))
    path = run_paper(cfg)
    logging.getLogger(__name__).info("report: %s", path)
    return 0
