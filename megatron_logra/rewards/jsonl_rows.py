"""One row of a JSONL problem file: the JSON object of a line turned into a :class:`~megatron_logra.rewards.base.Problem`.

Owns which keys a row's prompt, answer and id come from (the first present of ``prompt`` / ``problem`` /
``question``; ``answer``, else the last ``\\boxed{...}`` of ``solution``; ``id`` or ``unique_id``), a number answer's
plain decimal text, and what the other keys and ``metadata`` become, each refusal a ``ValueError`` naming
``PATH:LINE`` and the field. The file format as a whole (encoding, repeats, the drop of unparsable answers) is
described and read in :mod:`megatron_logra.rewards.jsonl`.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.math import extract_boxed


_PROMPT_KEYS = ("prompt", "problem", "question")
_ID_KEYS = ("id", "unique_id")
_CONSUMED = set(_PROMPT_KEYS) | set(_ID_KEYS) | {"answer", "metadata"}


def _number_text(value: int | float, where: str) -> str:
    """Plain decimal text of a JSON number (never exponent notation); non-finite numbers are refused."""
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: 'answer' must be a finite number, got {value!r}; give the answer as a string "
                         f"(e.g. \"\\\\infty\") if that is what is meant")
    return format(Decimal(repr(value)), "f")


def _answer_of(obj: dict[str, Any], where: str) -> str:
    answer = obj.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
        text = _number_text(answer, where) if isinstance(answer, (int, float)) else answer.strip()
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
    if id_key is not None:
        raw_id = obj[id_key]
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or not str(raw_id).strip():
            raise ValueError(f"{where}: {id_key!r} must be a non-empty string or an integer, got {raw_id!r}; "
                             f"fix it or drop the key (the id then defaults to {source}:{line})")
    metadata["id"] = str(obj[id_key]) if id_key is not None else f"{source}:{line}"
    metadata["line"] = line
    return Problem(prompt=prompt, answer=answer, source=source, metadata=metadata)
