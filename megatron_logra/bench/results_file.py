"""The results JSON of a paper-bench report (``OUT_DIR/results/STEM.json``) read back for re-rendering.

:func:`load_results` rebuilds the keyword arguments of :func:`~megatron_logra.bench.report.render_report`
from what :func:`~megatron_logra.bench.report.write_report` stored, so a report can be rewritten after a
change of wording without rerunning it. A file that cannot be used is bad input, not a bug: it raises
:class:`ResultsFileError` naming the file and the problem, which the command line prints as one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megatron_logra.bench.accuracy_fig import RunResult
from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.memory_fig import MemoryRow

logger = logging.getLogger(__name__)

__all__ = ["ResultsFileError", "SHAPE_ERRORS", "IMAGE_NAMES", "describe_shape_error", "load_results",
           "present_images"]


class ResultsFileError(ValueError):
    """A results JSON that :func:`load_results` / :func:`~megatron_logra.bench.rerender.render_only` cannot
    use: missing, unreadable, not JSON, or not the numbers of a report. The message starts with the file's path and says what is wrong."""


def describe_shape_error(exc: BaseException) -> str:
    """What ``exc``, raised while reading a results JSON's fields, says about the file."""
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}" if exc.args else "a missing key"
    return f"{type(exc).__name__}: {exc}"


SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What a results JSON of the wrong shape (a missing key, a list for a dict, a string for a number)
raises while it is read or rendered."""


def load_results(path: Path) -> dict[str, Any]:
    """The keyword arguments of :func:`~megatron_logra.bench.report.render_report` (and the config) rebuilt from a
    ``results/STEM.json`` written by :func:`~megatron_logra.bench.report.write_report`, to re-render a report without
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
    except SHAPE_ERRORS as exc:
        raise ResultsFileError(f"{path} is not a results file of `megatron-logra bench paper`: "
                               f"{describe_shape_error(exc)}") from exc


def _results_from(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """:func:`load_results` of the parsed JSON object ``data`` of ``path`` (KeyError, TypeError, ... when it
    is not shaped like one)."""
    from megatron_logra.bench.provenance import command_line
    from megatron_logra.bench.report_names import image_prefix

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
    images = present_images(Path(path).parent, image_prefix(cfg))
    return {"cfg": cfg, "timings": data["timings"], "missing": data["missing"],
            "memory": [MemoryRow(**m) for m in data["memory"]], "planned": data["planner"],
            "by_optimizer": {k: v for k, v in by_optimizer.items() if v},
            "by_rank": {k: v for k, v in by_rank.items() if v}, "cosines": data["cosines"],
            "kl_rows": data["kl"], "images": images, "command": data.get("command") or command_line(cfg),
            "environment": data.get("environment"), "data": data}


IMAGE_NAMES = {"memory": "fig1_memory.png", "accuracy": "fig2_accuracy.png", "rank": "fig5a_rank.png",
                "cosine_single": "fig5b_cosine_single.png", "cosine_accumulated": "fig5c_cosine_accumulated.png",
                "kl": "fig6_kl.png"}
"""The report's images by key, without the run's prefix (:func:`~megatron_logra.bench.report_names.image_prefix`)."""


def present_images(results_dir: Path, prefix: str) -> dict[str, str]:
    """The report's images present under ``results_dir`` with ``prefix``, as the report links them."""
    return {k: f"results/{prefix}{v}" for k, v in IMAGE_NAMES.items() if (results_dir / f"{prefix}{v}").exists()}
