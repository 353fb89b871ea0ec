"""``megatron-logra bench paper --render-only``: rewrite a report from the numbers of an earlier run.

The report of the given flags is read from its JSON (:mod:`~megatron_logra.bench.results_file`) and
re-rendered, never rerun, so a change of wording reaches the committed reports without rerunning them.
A JSON under that name that recorded the run of other settings is refused naming the command that wrote it,
since re-rendering it would put another run's numbers under these flags' name.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.results_file import (
    IMAGE_NAMES, SHAPE_ERRORS, ResultsFileError, describe_shape_error, load_results, present_images,
)

logger = logging.getLogger(__name__)

__all__ = ["render_only"]


def render_only(out_dir: Path, *, quick: bool, cfg: Optional[PaperBenchConfig] = None) -> int:
    """Rewrite the report from the numbers of an earlier run (after a change of wording): the report of
    ``cfg`` (default: the quick or full preset), read from ``OUT_DIR/results/<its stem>.json``. Returns 0.
    A missing, unreadable or malformed JSON raises :class:`ResultsFileError` naming it and the problem
    (for a missing one: the command whose run writes it), before anything is written.

    A run with other settings than the preset's written before reports were named by those settings has its
    JSON and PNGs under the older name (:func:`~megatron_logra.bench.report_names.legacy_report_stem`,
    ``results-quick-custom.json``): when the current name is missing that one is read, provided it recorded
    the run of these flags (every custom run shared that name), and the report is written under the current
    name, its PNGs copied to the current prefix; the older files are left as they are."""
    from megatron_logra.bench import provenance, report, report_names

    cfg = cfg if cfg is not None else PaperBenchConfig.preset(quick, out_dir=str(out_dir))
    results_dir = Path(out_dir) / "results"
    source = results_dir / f"{report_names.report_stem(cfg)}.json"
    legacy = report_names.legacy_report_stem(cfg)
    legacy_source = results_dir / f"{legacy}.json" if legacy else None
    if not source.exists():
        if legacy_source is None or not legacy_source.exists():
            older = f" (nor its older name {legacy_source.name})" if legacy_source is not None else ""
            raise ResultsFileError(f"{source} does not exist{older}: --render-only re-renders the report of an "
                                   f"earlier run with the same flags; run `{provenance.command_line(cfg)}` first")
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
                               f"the report of these flags needs its own run: `{provenance.command_line(wanted)}`")
    if differ:  # another custom run of the same stem: its report is not the one these flags ask for
        raise ResultsFileError(f"{source} holds the run of `{kw['command']}`, not of these flags ({differ}): "
                               f"--render-only re-renders the report of an earlier run with the same flags; run "
                               f"`{provenance.command_line(wanted)}` first")
    cfg.out_dir = str(out_dir)
    if source == legacy_source:
        _adopt_legacy_images(results_dir, report_names.legacy_image_prefix(cfg) or "",
                             report_names.image_prefix(cfg))
        kw["images"] = present_images(results_dir, report_names.image_prefix(cfg))
    try:
        text = report.render_report(cfg, **kw)
    except SHAPE_ERRORS as exc:
        raise ResultsFileError(f"{source} is not a results file of `megatron-logra bench paper` (rendering it "
                               f"failed): {describe_shape_error(exc)}") from exc
    path = report.write_report(cfg, text, data)
    logger.info("re-rendered %s from %s", path, source)
    return 0


def _adopt_legacy_images(results_dir: Path, old_prefix: str, new_prefix: str) -> None:
    """Copy the PNGs of a report under its older prefix to its current one (an existing one is kept)."""
    for name in IMAGE_NAMES.values():
        old, new = results_dir / f"{old_prefix}{name}", results_dir / f"{new_prefix}{name}"
        if old.exists() and not new.exists():
            shutil.copyfile(old, new)


def _settings_differ(wanted: PaperBenchConfig, recorded: PaperBenchConfig) -> str:
    """The settings (output and run directories aside) in which ``recorded`` differs from ``wanted``, as
    ``name: recorded -> wanted``; empty when they agree. The figure groups are compared as a set: a run draws
    them in report order whatever the order of ``--figures``, and their order names no other report."""
    a, b = json.loads(json.dumps(asdict(wanted))), json.loads(json.dumps(asdict(recorded)))
    if sorted(a["figures"]) == sorted(b["figures"]):
        b["figures"] = a["figures"]
    return ", ".join(f"{k}: {b[k]!r} -> {a[k]!r}" for k in a if k not in ("out_dir", "run_root") and a[k] != b[k])
