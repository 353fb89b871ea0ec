"""One row of a JSONL problem file: the JSON object of a line turned into a :class:`~megatron_logra.rewards.base.Problem`.

Owns which keys a row's prompt, answer and id come from, a number answer's plain decimal text, and what the other
keys and ``metadata`` become, each refusal a ``ValueError`` naming ``PATH:LINE`` and the field. The file format as
a whole (encoding, repeats, the drop of unparsable answers) is described and read in
:mod:`megatron_logra.rewards.jsonl`.

* **Prompt**: ``task.jsonl_prompt_key`` (slime's ``--input-key``) when given, else the first present of ``prompt`` /
  ``problem`` / ``question``; a string, or a chat-message list holding one user message (``[{"role": "user",
  "content": "..."}]``, as slime's and verl's prepared datasets write it), whose content is the prompt.
* **Answer**: ``task.jsonl_answer_key`` (``--label-key``; a dotted key reaches into an object,
  ``reward_model.ground_truth``) when given, else the first present of ``answer``, ``label`` (slime) and
  ``reward_model.ground_truth`` (verl), else the last ``\\boxed{...}`` of ``solution``. A string or a finite number;
  a GSM8K answer (a worked solution whose last line is ``#### 72``) is the text after that ``####``.
* **Id**: ``id`` or ``unique_id``.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.math import extract_boxed


_PROMPT_KEYS = ("prompt", "problem", "question")
_ANSWER_KEYS = ("answer", "label", "reward_model.ground_truth")
_ID_KEYS = ("id", "unique_id")
_CONSUMED = set(_PROMPT_KEYS) | set(_ID_KEYS) | {"answer", "label", "metadata"}
_GSM8K_MARK = "####"


def _lookup(obj: dict[str, Any], key: str) -> tuple[bool, Any]:
    """``(present, value)`` of ``key`` in ``obj``; a dotted key reaches into nested objects (``a.b``: ``obj["a"]["b"]``)
    unless ``obj`` holds the dotted key itself."""
    if key in obj:
        return True, obj[key]
    value: Any = obj
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _number_text(value: int | float, where: str) -> str:
    """Plain decimal text of a JSON number (never exponent notation); non-finite numbers are refused."""
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: 'answer' must be a finite number, got {value!r}; give the answer as a string "
                         f"(e.g. \"\\\\infty\") if that is what is meant")
    return format(Decimal(repr(value)), "f")


def _answer_text(answer: Any, key: str, where: str) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: {key!r} must be a string or a number, got {type(answer).__name__}")
    if not isinstance(answer, str):
        return _number_text(answer, where)
    text = answer.strip()
    last_line = text.rsplit("\n", 1)[-1].strip()
    if last_line.startswith(_GSM8K_MARK):  # GSM8K: "...worked solution\n#### 72"
        text = last_line[len(_GSM8K_MARK):].strip()
    if not text:
        raise ValueError(f"{where}: {key!r} is empty")
    return text


def _answer_of(obj: dict[str, Any], where: str, answer_key: str = "") -> tuple[str, Any]:
    """The row's reference answer: its text, and the JSON number it was where it was one (else None)."""
    if answer_key:
        present, answer = _lookup(obj, answer_key)
        if not present or answer is None:
            raise ValueError(f"{where}: no {answer_key!r} (task.jsonl_answer_key); keys present: {sorted(obj)}")
        return _answer_text(answer, answer_key, where), _number_or_none(answer)
    for key in _ANSWER_KEYS:
        present, answer = _lookup(obj, key)
        if present and answer is not None:
            return _answer_text(answer, key, where), _number_or_none(answer)
    solution = obj.get("solution")
    if isinstance(solution, str):
        boxed = extract_boxed(solution)
        if boxed:
            return boxed, None
        raise ValueError(f"{where}: no 'answer' key and 'solution' has no \\boxed{{...}} final answer")
    raise ValueError(f"{where}: missing 'answer' (or 'label', 'reward_model.ground_truth', a 'solution' with "
                     f"\\boxed{{...}}, or the key task.jsonl_answer_key names); keys present: {sorted(obj)}")


def _number_or_none(answer: Any) -> Any:
    """A JSON number answer as it was (``_answer_text`` already refused bools and non-finite numbers), else None."""
    return answer if isinstance(answer, (int, float)) and not isinstance(answer, bool) else None


def _prompt_text(prompt: Any, key: str, where: str) -> str:
    """A row's prompt: a non-empty string, or the content of a chat-message list's one user message."""
    if isinstance(prompt, list):
        roles = [m.get("role") if isinstance(m, dict) else None for m in prompt]
        if roles != ["user"] or not isinstance(prompt[0].get("content"), str):
            raise ValueError(
                f"{where}: {key!r} is a list of {len(prompt)} message{'' if len(prompt) == 1 else 's'} with roles "
                f"{roles}; a chat-message prompt must "
                f"be one user message [{{\"role\": \"user\", \"content\": \"...\"}}] (its content is the "
                f"prompt; rl.chat_template=true applies the tokenizer's chat template to it, and a system prompt "
                f"belongs in rl.prompt_template)")
        prompt = prompt[0]["content"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: {key!r} must be a non-empty string (or one user message)")
    return prompt


def _problem_of(obj: Any, source: str, where: str, line: int, prompt_key: str = "", answer_key: str = "") -> Problem:
    """The problem of one row; ``prompt_key`` / ``answer_key``: ``task.jsonl_prompt_key`` / ``task.jsonl_answer_key``
    (empty: the usual keys, see the module doc)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if prompt_key:
        present, prompt = _lookup(obj, prompt_key)
        if not present:
            raise ValueError(f"{where}: no {prompt_key!r} (task.jsonl_prompt_key); keys present: {sorted(obj)}")
        key = prompt_key
    else:
        key = next((k for k in _PROMPT_KEYS if k in obj), None)
        if key is None:
            raise ValueError(f"{where}: missing 'prompt' (or 'problem' / 'question', or the key task.jsonl_prompt_key "
                             f"names); keys present: {sorted(obj)}")
        prompt = obj[key]
    prompt = _prompt_text(prompt, key, where)
    answer, raw_answer = _answer_of(obj, where, answer_key)
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: 'metadata' must be a JSON object, got {type(meta).__name__}")
    consumed = _CONSUMED | {prompt_key.split(".")[0], answer_key.split(".")[0]}
    metadata: dict[str, Any] = {k: v for k, v in obj.items() if k not in consumed}
    metadata.update(meta)
    id_key = next((k for k in _ID_KEYS if k in obj), None)
    if id_key is not None:
        raw_id = obj[id_key]
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or not str(raw_id).strip():
            raise ValueError(f"{where}: {id_key!r} must be a non-empty string or an integer, got {raw_id!r}; "
                             f"fix it or drop the key (the id then defaults to {source}:{line})")
    metadata["id"] = str(obj[id_key]) if id_key is not None else f"{source}:{line}"
    metadata["line"] = line
    return Problem(prompt=prompt, answer=answer, source=source, metadata=metadata, raw_answer=raw_answer)
