"""File names of a paper-bench report: the stem of ``STEM.md`` / ``results/STEM.json`` and the PNG prefix.

Only the complete preset runs are named ``results`` / ``results-quick``: a run of some figures or with
other settings gets a stem that names them (:func:`report_stem`, e.g. ``results-cosine``,
``results-quick-seeds_1_2-accuracy-kl``), so it never replaces the full report nor the report of a run
with other settings. Reports of custom runs written before they were named by their settings were all
``results[-quick]-custom[-FIGURE...]`` (:func:`legacy_report_stem`), which ``--render-only`` still finds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict
from typing import Any, Optional

from megatron_logra.bench.config import PaperBenchConfig

logger = logging.getLogger(__name__)

__all__ = ["FIGURES", "SETTINGS_NAME_LIMIT", "plain_settings", "is_custom", "report_stem", "image_prefix",
           "legacy_report_stem", "legacy_image_prefix"]

FIGURES = ("memory", "accuracy", "cosine", "kl")
"""The figure groups, in report order."""


def plain_settings(cfg: PaperBenchConfig) -> dict[str, Any]:
    """``cfg``'s fields as JSON values (tuples as lists), so that two configs compare as their JSON would."""
    return json.loads(json.dumps(asdict(cfg)))


def _changed_settings(cfg: PaperBenchConfig) -> dict[str, Any]:
    """The settings in which ``cfg`` differs from its preset (the figures, output and run directories aside),
    in field order, as JSON values. ``eval_interval`` counts only when it is not what ``--rl-steps`` alone
    gives it (``min(preset's interval, rl_steps)``)."""
    preset = PaperBenchConfig.preset(cfg.quick, out_dir=cfg.out_dir, run_root=cfg.run_root, figures=list(cfg.figures))
    mine, theirs = plain_settings(cfg), plain_settings(preset)
    theirs["eval_interval"] = min(preset.eval_interval, cfg.rl_steps)
    return {k: v for k, v in mine.items() if v != theirs[k]}


def is_custom(cfg: PaperBenchConfig) -> bool:
    """Any setting other than the preset's (the figures, output and run directories aside)."""
    preset = PaperBenchConfig.preset(cfg.quick, out_dir=cfg.out_dir, run_root=cfg.run_root, figures=list(cfg.figures))
    return plain_settings(cfg) != plain_settings(preset)


def _name_part(value: Any) -> str:
    """``value`` (a JSON value of a setting) in a file name: list entries joined by ``_``, pairs by ``x``
    (``[[64, 1], [128, 1]]`` -> ``64x1_128x1``), other characters than letters, digits, ``.`` and ``-`` dropped."""
    if isinstance(value, list):
        return "_".join("x".join(map(_name_part, v)) if isinstance(v, list) else _name_part(v) for v in value)
    if isinstance(value, float):
        value = f"{value:g}"
    return re.sub(r"[^A-Za-z0-9.-]+", "", str(value))


SETTINGS_NAME_LIMIT = 120
"""Longest settings part of a report stem; a longer one is replaced by ``custom-`` and a hash of the settings."""


def _settings_name(cfg: PaperBenchConfig) -> str:
    """The part of the report stem naming the settings that differ from the preset (:func:`_changed_settings`),
    ``NAME_VALUES`` joined by ``-`` (``seeds_1_2-rl-steps_3``); empty for a preset run. Beyond
    :data:`SETTINGS_NAME_LIMIT` characters: ``custom-`` and the first 10 hex digits of the settings' SHA-256."""
    changed = _changed_settings(cfg)
    name = "-".join(f"{k.replace('_', '-')}_{_name_part(v)}" for k, v in changed.items())
    if len(name) > SETTINGS_NAME_LIMIT:
        digest = hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]
        name = f"custom-{digest}"
    return name


def report_stem(cfg: PaperBenchConfig) -> str:
    """File stem of the report and its JSON: ``results`` / ``results-quick`` for a complete preset run; the
    settings that differ from the preset when any do, each as ``NAME_VALUES`` (``results-seeds_1``,
    ``results-quick-rl-steps_10-optimizers_logra_adam``, so runs of different settings never share a name), and
    the figure groups (``-cosine``, ``-memory-kl``) when not all of them ran."""
    stem = "results-quick" if cfg.quick else "results"
    settings = _settings_name(cfg)
    if settings:
        stem += f"-{settings}"
    if set(cfg.figures) != set(FIGURES):
        stem += "".join(f"-{f}" for f in FIGURES if f in cfg.figures)
    return stem


def image_prefix(cfg: PaperBenchConfig) -> str:
    """Prefix of the PNG names under ``OUT_DIR/results/``: none for the full report, else the stem's suffix
    (``quick-``, ``cosine-``, ``quick-seeds_1-memory-``)."""
    stem = report_stem(cfg)
    return "" if stem == "results" else stem[len("results-"):] + "-"


def legacy_report_stem(cfg: PaperBenchConfig) -> Optional[str]:
    """The stem an earlier version gave the report of ``cfg`` when it differs from :func:`report_stem`, else None:
    every run with settings other than the preset's was ``results[-quick]-custom[-FIGURE...]`` whatever they were
    (so one such JSON may hold the run of any custom settings: :func:`~megatron_logra.bench.rerender.render_only`
    checks its recorded config)."""
    if not is_custom(cfg):
        return None
    stem = ("results-quick" if cfg.quick else "results") + "-custom"
    if set(cfg.figures) != set(FIGURES):
        stem += "".join(f"-{f}" for f in FIGURES if f in cfg.figures)
    return stem if stem != report_stem(cfg) else None


def legacy_image_prefix(cfg: PaperBenchConfig) -> Optional[str]:
    """The PNG prefix that went with :func:`legacy_report_stem` (``quick-custom-memory-``), or None."""
    stem = legacy_report_stem(cfg)
    return None if stem is None else stem[len("results-"):] + "-"
