"""Local JSONL problem files that users bring (e.g. MATH-500), scored with math-verify by default.

Format: one JSON object per line (blank lines are skipped).

* prompt: the first present of ``"prompt"``, ``"problem"``, ``"question"`` (a non-empty string);
* answer: ``"answer"`` (a string or a number), else the last ``\\boxed{...}`` of ``"solution"``;
* optional ``"id"`` (or ``"unique_id"``, as in MATH-500) and ``"metadata"`` (an object);
* every other key (``subject``, ``level``, ...) is kept in ``Problem.metadata`` as well, together
  with ``"line"`` (1-based line number) and ``"id"``.

Malformed input raises ValueError naming ``PATH:LINE`` and what is wrong; a missing file raises
FileNotFoundError naming the path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.math import extract_boxed

__all__ = ["JSONL_PREFIX", "JsonlSource", "load_jsonl_problems"]

logger = logging.getLogger(__name__)

JSONL_PREFIX = "jsonl:"
"""Prefix of a dataset spec that names a local JSONL file: ``jsonl:PATH``."""

_PROMPT_KEYS = ("prompt", "problem", "question")
_ID_KEYS = ("id", "unique_id")
_CONSUMED = set(_PROMPT_KEYS) | set(_ID_KEYS) | {"answer", "metadata"}


def _answer_of(obj: dict[str, Any], where: str) -> str:
    answer = obj.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
        text = str(answer).strip()
        if not text:
            raise ValueError(f"{where}: 'answer' is empty")
        return text
    solution = obj.get("solution")
    if isinstance(solution, str):
        boxed = extract_boxed(solution)
        if boxed:
            return boxed
        raise ValueError(f"{where}: no 'answer' key and 'solution' has no \\boxed{{...}} final answer")
    raise ValueError(f"{where}: missing 'answer' (or a 'solution' with \\boxed{{...}}); keys present: {sorted(obj)}")


def _problem_of(obj: Any, source: str, where: str, line: int) -> Problem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt_key = next((k for k in _PROMPT_KEYS if k in obj), None)
    if prompt_key is None:
        raise ValueError(f"{where}: missing 'prompt' (or 'problem' / 'question'); keys present: {sorted(obj)}")
    prompt = obj[prompt_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string")
    answer = _answer_of(obj, where)
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: 'metadata' must be a JSON object, got {type(meta).__name__}")
    metadata: dict[str, Any] = {k: v for k, v in obj.items() if k not in _CONSUMED}
    metadata.update(meta)
    id_key = next((k for k in _ID_KEYS if k in obj), None)
    metadata["id"] = str(obj[id_key]) if id_key is not None else f"{source}:{line}"
    metadata["line"] = line
    return Problem(prompt=prompt, answer=answer, source=source, metadata=metadata)


def load_jsonl_problems(path: str | Path, source: str | None = None) -> list[Problem]:
    """All problems of a JSONL file, in file order; ``source`` defaults to ``"jsonl:" + path``.

    Raises FileNotFoundError for a missing path and ValueError (``PATH:LINE: ...``) for a malformed
    line or a file without problems.
    """
    path = Path(path)
    source = source if source is not None else f"{JSONL_PREFIX}{path}"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: JSONL problem file not found (dataset spec {source!r})")
    problems: list[Problem] = []
    with path.open("r", encoding="utf-8") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            problems.append(_problem_of(obj, source, where, line_no))
    if not problems:
        raise ValueError(f"{path}: no problems (the file is empty)")
    logger.info("loaded %d problems from %s", len(problems), path)
    return problems


class JsonlSource:
    """A finite problem source over a JSONL file; ``problem(i)`` is the ``i % size``-th line's problem."""

    def __init__(self, path: str | Path, source: str | None = None) -> None:
        self.path = Path(path)
        self.name = source if source is not None else f"{JSONL_PREFIX}{path}"
        self.problems = load_jsonl_problems(self.path, self.name)
        self.size: int | None = len(self.problems)

    def problem(self, raw_index: int) -> Problem:
        """The problem at ``raw_index % size`` (a shallow copy, so callers may edit it)."""
        p = self.problems[raw_index % len(self.problems)]
        return Problem(prompt=p.prompt, answer=p.answer, source=p.source, metadata=dict(p.metadata))
