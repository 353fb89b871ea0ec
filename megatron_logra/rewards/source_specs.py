"""Checking the source specs of ``task.datasets`` / ``task.eval_datasets``
(:class:`~megatron_logra.rewards.config.TaskConfig`): each entry a reasoning-gym dataset name or a file spec
(``jsonl:PATH``, ``parquet:PATH``), a misspelt name answered with the registered names it is close to, and the
resolved file of a spec, so that two spellings of one file compare equal.

Kept apart from the config's dataclass so that the field checks there stay readable; every refusal is a
``ValueError`` naming the field, the entry and the fix.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from typing import Any

from megatron_logra.rewards.jsonl import file_spec_path, join_jsonl_paths

__all__ = ["close_gym_names", "file_key", "source_specs"]

logger = logging.getLogger(__name__)

_GYM_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def source_specs(value: Any, name: str) -> list[str]:
    """``task.NAME`` (``datasets`` / ``eval_datasets``) as a checked list of source specs: a comma-separated
    string is split, ``jsonl:`` paths holding commas are joined back, and each entry must be a reasoning-gym name
    or ``jsonl:PATH``."""
    if isinstance(value, str):
        value = [s.strip() for s in value.split(",") if s.strip()]
    specs = join_jsonl_paths(list(value))
    for i, spec in enumerate(specs):
        if not isinstance(spec, str):
            raise ValueError(f"task.{name}[{i}]={spec!r} must be a string")
        path = file_spec_path(spec)
        if path is not None:
            if not path.strip():
                raise ValueError(f"task.{name}[{i}]={spec!r}: give a file path after {spec.split(':', 1)[0] + ':'!r}")
        elif not _GYM_NAME_RE.match(spec):
            raise ValueError(
                f"task.{name}[{i}]={spec!r}: expected a reasoning-gym name (lowercase, e.g. chain_sum), 'jsonl:PATH' or "
                f"'parquet:PATH'{close_gym_names(spec)}")
    return specs


def close_gym_names(spec: str) -> str:
    """``; did you mean chain_sum?`` for a misspelt reasoning-gym name (``Chain_Sum``, ``chain-sum``), else ``""``."""
    from megatron_logra.rewards.gym import list_gym_datasets

    try:
        names = list_gym_datasets()
    except ImportError:  # no reasoning-gym: nothing to suggest
        return ""
    close = difflib.get_close_matches(re.sub(r"[\s-]+", "_", spec.strip().lower()), names, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def file_key(spec: str) -> str:
    """A file spec's (``jsonl:PATH``, ``parquet:PATH``) file, resolved, so that two spellings of one file compare
    equal."""
    return os.path.realpath(os.path.expanduser(file_spec_path(spec) or ""))
