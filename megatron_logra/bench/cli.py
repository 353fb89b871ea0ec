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
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from megatron_logra.bench.accuracy_fig import RunResult
from megatron_logra.bench.config import KL_MODES, OPTIMIZERS, PaperBenchConfig
from megatron_logra.bench.memory_fig import MemoryRow

logger = logging.getLogger(__name__)

__all__ = ["add_parser", "build_parser", "main", "run_paper", "render_only", "load_results", "ResultsFileError",
           "unwritable_paths"]

PROG = "megatron-logra bench paper"
"""The command's name in its error messages (as argparse names it for the ``paper`` sub-command)."""


class ResultsFileError(ValueError):
    """A results JSON that :func:`load_results` / :func:`render_only` cannot use: missing, unreadable, not
    JSON, or not the numbers of a report. The message starts with the file's path and says what is wrong."""


def _describe(exc: BaseException) -> str:
    """What ``exc``, raised while reading a results JSON's fields, says about the file."""
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}" if exc.args else "a missing key"
    return f"{type(exc).__name__}: {exc}"


_SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What a results JSON of the wrong shape (a missing key, a list for a dict, a string for a number)
raises while it is read or rendered."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``paper`` sub-command to ``subparsers`` (of ``megatron-logra bench``)."""
    p = subparsers.add_parser("paper", help="small-scale paper figures vs GaLore and APOLLO",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="≈3 min budget: fewer steps, one seed, small sizes")
    p.add_argument("--out-dir", default="docs",
                   help="results.md (--quick: results-quick.md) goes here, PNGs and the JSON under OUT_DIR/results/; "
                        "a run of some --figures or with other settings writes a report named after them instead: "
                        "results[-quick][-SETTING_VALUES...][-FIGURE...].md, e.g. results-seeds_1_2-cosine.md "
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
    parser = argparse.ArgumentParser(prog="megatron-logra bench", description="benchmarks that write reports")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> PaperBenchConfig:
    """``PaperBenchConfig.preset(args.quick)`` with the flags given on top (ValueError names a bad field)."""
    overrides: dict[str, Any] = {"out_dir": args.out_dir, "run_root": args.run_root}
    for flag, name in (("figures", "figures"), ("optimizers", "optimizers"), ("kl_modes", "kl_modes"),
                       ("seeds", "seeds"), ("rl_steps", "rl_steps")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[name] = value
    if args.rl_steps is not None and args.rl_steps < PaperBenchConfig.preset(args.quick).eval_interval:
        overrides["eval_interval"] = args.rl_steps
    return PaperBenchConfig.preset(args.quick, **overrides)


def run_paper(cfg: PaperBenchConfig) -> Path:
    """Run every figure group of ``cfg`` and write the report; returns the report's path."""
    import torch

    from megatron_logra.bench import accuracy_fig, cosine_fig, kl_fig, memory_fig, report
    from megatron_logra.bench.peers import PEERS, peer_missing

    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    missing = {p: why for p in cfg.optimizers if p in PEERS for why in [peer_missing(p)] if why}
    for peer, why in missing.items():
        logger.warning("peer %s skipped: %s", peer, why)
    env = report.environment(cfg.threads)
    img_dir = Path(cfg.out_dir) / "results"
    prefix = report.image_prefix(cfg)
    images: dict[str, str] = {}

    def image(key: str, name: str) -> Path:
        images[key] = f"results/{prefix}{name}"
        return img_dir / f"{prefix}{name}"

    memory, planned = [], []
    if "memory" in cfg.figures:
        t0 = time.perf_counter()
        memory = memory_fig.measure_memory(cfg)
        planned = memory_fig.planner_rows(cfg)
        memory_fig.plot_memory(memory, planned, cfg.optimizers, image("memory", "fig1_memory.png"))
        timings["memory"] = time.perf_counter() - t0
    cache = accuracy_fig.RunCache(cfg)
    by_optimizer: dict[str, list] = {}
    by_rank: dict[int, list] = {}
    if "accuracy" in cfg.figures:
        t0 = time.perf_counter()
        for seed in cfg.seeds:  # seed-major: a partial run still has every optimizer side by side
            for opt in cfg.optimizers:
                by_optimizer.setdefault(opt, []).append(cache.optimizer(opt, seed))
        accuracy_fig.plot_accuracy(by_optimizer, image("accuracy", "fig2_accuracy.png"))
        for rank in cfg.ranks:
            label = "logra" if rank == 32 else f"logra-r{rank}"
            by_rank[rank] = [cache.get(label, seed, "logra", rank=rank) for seed in cfg.rank_seeds]
        accuracy_fig.plot_rank(by_rank, by_optimizer.get("adam", []), image("rank", "fig5a_rank.png"))
        timings["accuracy"] = time.perf_counter() - t0
    cosines: Optional[dict] = None
    if "cosine" in cfg.figures:
        t0 = time.perf_counter()
        cosines = cosine_fig.measure_cosines(cfg)
        cosine_fig.plot_cosines(cosines, image("cosine_single", "fig5b_cosine_single.png"),
                                image("cosine_accumulated", "fig5c_cosine_accumulated.png"))
        timings["cosine"] = time.perf_counter() - t0
    kl_rows: list[dict] = []
    if "kl" in cfg.figures:
        t0 = time.perf_counter()
        by_mode = kl_fig.kl_runs(cfg, cache)
        kl_rows = kl_fig.kl_summary(by_mode)
        kl_fig.plot_kl(by_mode, image("kl", "fig6_kl.png"))
        timings["kl"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    command = report.command_line(cfg)
    text = report.render_report(cfg, timings=timings, missing=missing, memory=memory, planned=planned,
                                by_optimizer=by_optimizer, by_rank=by_rank, cosines=cosines, kl_rows=kl_rows,
                                images=images, command=command, environment=env)
    data = {"config": asdict(cfg), "command": command, "environment": env, "timings": timings, "missing": missing,
            "memory": [asdict(r) for r in memory], "planner": planned,
            "runs": {f"{k[0]}-seed{k[1]}": {"eval_before": r.eval_before, "eval_after": r.eval_after,
                                            "curve": r.curve, "wall_seconds": r.wall_seconds, "rl_seconds": r.rl_seconds,
                                            "skipped": r.skipped}
                     for k, r in cache.runs.items()},
            "cosines": cosines, "kl": kl_rows}
    path = report.write_report(cfg, text, data)
    logger.info("bench paper done in %.1f min: %s", timings["total"] / 60, path)
    return path


def load_results(path: Path) -> dict[str, Any]:
    """The keyword arguments of :func:`render_report` (and the config) rebuilt from a
    ``results/STEM.json`` written by :func:`write_report`, to re-render a report without
    rerunning it. Per-update records are not stored there; the KL rows are. The command and
    environment are the recorded ones (a JSON from before they were recorded: the command rebuilt
    from its config, the environment None). A file that cannot be read, is not JSON or lacks what a
    report needs raises :class:`ResultsFileError` naming it and the problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsFileError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ResultsFileError(f"{path} cannot be read as a results file: {reason}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from exc
    if not isinstance(data, dict):
        raise ResultsFileError(f"{path} holds a JSON {type(data).__name__}, not the object of a results file "
                               f"(written by `megatron-logra bench paper`)")
    try:
        return _results_from(path, data)
    except _SHAPE_ERRORS as exc:
        raise ResultsFileError(f"{path} is not a results file of `megatron-logra bench paper`: {_describe(exc)}") \
            from exc


def _results_from(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """:func:`load_results` of the parsed JSON object ``data`` of ``path`` (KeyError, TypeError, ... when it
    is not shaped like one)."""
    from megatron_logra.bench.report import command_line, image_prefix

    cfg = PaperBenchConfig(**{k: ([tuple(x) for x in v] if k == "memory_sizes" else v)
                              for k, v in data["config"].items()})
    runs = {}
    for key, r in data["runs"].items():
        label, seed = key.rsplit("-seed", 1)
        runs[(label, int(seed))] = RunResult(label=label, seed=int(seed), eval_before=r["eval_before"],
                                             eval_after=r["eval_after"], curve=[tuple(x) for x in r["curve"]],
                                             wall_seconds=r["wall_seconds"], rl_seconds=r.get("rl_seconds", 0.0),
                                             skipped=r["skipped"])
    by_optimizer = {o: [runs[(o, s)] for s in cfg.seeds if (o, s) in runs] for o in cfg.optimizers}
    by_rank = {k: [runs[(lab, s)] for s in cfg.rank_seeds if (lab, s) in runs]
               for k in cfg.ranks for lab in ["logra" if k == 32 else f"logra-r{k}"]}
    images = _images(Path(path).parent, image_prefix(cfg))
    return {"cfg": cfg, "timings": data["timings"], "missing": data["missing"],
            "memory": [MemoryRow(**m) for m in data["memory"]], "planned": data["planner"],
            "by_optimizer": {k: v for k, v in by_optimizer.items() if v},
            "by_rank": {k: v for k, v in by_rank.items() if v}, "cosines": data["cosines"],
            "kl_rows": data["kl"], "images": images, "command": data.get("command") or command_line(cfg),
            "environment": data.get("environment"), "data": data}


_IMAGE_NAMES = {"memory": "fig1_memory.png", "accuracy": "fig2_accuracy.png", "rank": "fig5a_rank.png",
                "cosine_single": "fig5b_cosine_single.png", "cosine_accumulated": "fig5c_cosine_accumulated.png",
                "kl": "fig6_kl.png"}
"""The report's images by key, without the run's prefix (:func:`~megatron_logra.bench.report.image_prefix`)."""


def _images(results_dir: Path, prefix: str) -> dict[str, str]:
    """The report's images present under ``results_dir`` with ``prefix``, as the report links them."""
    return {k: f"results/{prefix}{v}" for k, v in _IMAGE_NAMES.items() if (results_dir / f"{prefix}{v}").exists()}


def render_only(out_dir: Path, *, quick: bool, cfg: Optional[PaperBenchConfig] = None) -> int:
    """Rewrite the report from the numbers of an earlier run (after a change of wording): the report of
    ``cfg`` (default: the quick or full preset), read from ``OUT_DIR/results/<its stem>.json``. Returns 0.
    A missing, unreadable or malformed JSON raises :class:`ResultsFileError` naming it and the problem
    (for a missing one: the command whose run writes it), before anything is written.

    A run with other settings than the preset's written before reports were named by those settings has its
    JSON and PNGs under the older name (:func:`~megatron_logra.bench.report.legacy_report_stem`,
    ``results-quick-custom.json``): when the current name is missing that one is read, provided it recorded
    the run of these flags (every custom run shared that name), and the report is written under the current
    name, its PNGs copied to the current prefix; the older files are left as they are."""
    from megatron_logra.bench import report

    cfg = cfg if cfg is not None else PaperBenchConfig.preset(quick, out_dir=str(out_dir))
    results_dir = Path(out_dir) / "results"
    source = results_dir / f"{report.report_stem(cfg)}.json"
    legacy = report.legacy_report_stem(cfg)
    legacy_source = results_dir / f"{legacy}.json" if legacy else None
    if not source.exists():
        if legacy_source is None or not legacy_source.exists():
            older = f" (nor its older name {legacy_source.name})" if legacy_source is not None else ""
            raise ResultsFileError(f"{source} does not exist{older}: --render-only re-renders the report of an "
                                   f"earlier run with the same flags; run `{report.command_line(cfg)}` first")
        logger.info("%s does not exist: reading %s, the name reports of runs with other settings than the "
                    "preset's had before they were named by those settings", source.name, legacy_source)
        source = legacy_source
    kw = load_results(source)
    wanted = cfg
    cfg, data = kw.pop("cfg"), kw.pop("data")
    differ = _settings_differ(wanted, cfg)
    if differ and source == legacy_source:  # that name was shared by every custom run
        raise ResultsFileError(f"{source} (the name every run with other settings than the preset's had before "
                               f"reports were named by their settings) holds the run of `{kw['command']}`, not of "
                               f"these flags ({differ}): re-render it with that command's flags and --render-only; "
                               f"the report of these flags needs its own run: `{report.command_line(wanted)}`")
    if differ:  # another custom run of the same stem: its report is not the one these flags ask for
        raise ResultsFileError(f"{source} holds the run of `{kw['command']}`, not of these flags ({differ}): "
                               f"--render-only re-renders the report of an earlier run with the same flags; run "
                               f"`{report.command_line(wanted)}` first")
    cfg.out_dir = str(out_dir)
    if source == legacy_source:
        _adopt_legacy_images(results_dir, report.legacy_image_prefix(cfg) or "", report.image_prefix(cfg))
        kw["images"] = _images(results_dir, report.image_prefix(cfg))
    try:
        text = report.render_report(cfg, **kw)
    except _SHAPE_ERRORS as exc:
        raise ResultsFileError(f"{source} is not a results file of `megatron-logra bench paper` (rendering it "
                               f"failed): {_describe(exc)}") from exc
    path = report.write_report(cfg, text, data)
    logger.info("re-rendered %s from %s", path, source)
    return 0


def _adopt_legacy_images(results_dir: Path, old_prefix: str, new_prefix: str) -> None:
    """Copy the PNGs of a report under its older prefix to its current one (an existing one is kept)."""
    for name in _IMAGE_NAMES.values():
        old, new = results_dir / f"{old_prefix}{name}", results_dir / f"{new_prefix}{name}"
        if old.exists() and not new.exists():
            shutil.copyfile(old, new)


def _settings_differ(wanted: PaperBenchConfig, recorded: PaperBenchConfig) -> str:
    """The settings (output and run directories aside) in which ``recorded`` differs from ``wanted``, as
    ``name: recorded -> wanted``; empty when they agree."""
    a, b = json.loads(json.dumps(asdict(wanted))), json.loads(json.dumps(asdict(recorded)))
    return ", ".join(f"{k}: {b[k]!r} -> {a[k]!r}" for k in a if k not in ("out_dir", "run_root") and a[k] != b[k])


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
    from megatron_logra.bench.report import report_stem

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
