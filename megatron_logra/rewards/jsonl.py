"""Local JSONL problem files that users bring (e.g. MATH-500), scored with math-verify by default.

Format: one JSON object per line (blank lines are skipped).

* prompt: the first present of ``"prompt"``, ``"problem"``, ``"question"`` (a non-empty string, or one user
  message ``[{"role": "user", "content": ...}]``), or the key ``task.jsonl_prompt_key`` names;
* answer: ``"answer"``, ``"label"`` or ``"reward_model.ground_truth"`` (a string or a finite number; a GSM8K
  solution ending in ``#### 72`` gives ``72``), else the last ``\\boxed{...}`` of ``"solution"``, or the key
  ``task.jsonl_answer_key`` names. A number becomes its plain decimal text (``1e-7`` -> ``"0.0000001"``, ``1e20`` ->
  ``"100000000000000000000"``): math-verify reads ``1e-07`` as Euler's number minus 7;
* optional ``"id"`` (or ``"unique_id"``, as in MATH-500; a non-empty string or an integer) and
  ``"metadata"`` (an object);
* every other key (``subject``, ``level``, ...) is kept in ``Problem.metadata`` as well, together
  with ``"line"`` (1-based line number) and ``"id"`` (``"jsonl:PATH:LINE"`` when the row has none).

The file must be UTF-8 (a leading byte-order mark is accepted). Ids must be unique and each prompt
text may appear on one line only — also when both lines give the same answer, and also when the two texts differ
only in whitespace (:func:`~megatron_logra.rewards.base.same_prompt_key`): the prompt is the
unit of the train/eval split, a repeated one would be sampled twice as often, and two answers for
it would reward and penalise the same completion.

A path may hold commas: where ``task.datasets`` is given as one comma-separated string (the command line), the
pieces after a ``jsonl:`` piece are joined back into its path (:func:`join_jsonl_paths`).

Scored with math-verify (``task.reward`` ``auto`` or ``math_verify``), a row whose gold answer math-verify cannot
parse could never be rewarded: such rows are dropped when the task is built, with one warning naming the file, how
many and the first lines (:meth:`JsonlSource.drop_unparsable_answers`); a file of no other rows is refused. Under
a multi-process job rank 0 decides which rows go and every rank drops the same ones (a parse near math-verify's
time limit could otherwise fail on one rank only).

Malformed input (not UTF-8, invalid JSON, a key repeated within one object, a missing or mistyped
field, a non-finite number answer, a null, repeated or mistyped id, a repeated prompt) raises
ValueError naming ``PATH:LINE`` (and, for repeats, the earlier line) and what is wrong; a missing
file raises FileNotFoundError and a directory IsADirectoryError, naming the path. What one row becomes (its
keys, answer text and metadata) is :mod:`megatron_logra.rewards.jsonl_rows`; reading the lines,
:mod:`megatron_logra.rewards.jsonl_read`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

from megatron_logra.rewards.base import Problem, same_prompt_key
from megatron_logra.rewards.jsonl_read import json_lines, parquet_rows
from megatron_logra.rewards.jsonl_rows import _problem_of

__all__ = ["JSONL_PREFIX", "PARQUET_PREFIX", "FILE_PREFIXES", "JsonlSource", "file_spec_path", "load_jsonl_problems",
           "join_jsonl_paths"]

logger = logging.getLogger(__name__)

JSONL_PREFIX = "jsonl:"
"""Prefix of a dataset spec that names a local JSONL file: ``jsonl:PATH``."""

PARQUET_PREFIX = "parquet:"
"""Prefix of a dataset spec that names a local Parquet file (verl's prepared datasets): ``parquet:PATH``. Its rows
are read as a JSONL file's objects are (needs ``pyarrow``)."""

FILE_PREFIXES = (JSONL_PREFIX, PARQUET_PREFIX)
"""The prefixes of dataset specs that name a file of problems."""


def file_spec_path(spec: str) -> str | None:
    """The path of a file spec (``jsonl:PATH`` / ``parquet:PATH``); None for another spec (a reasoning-gym name)."""
    for prefix in FILE_PREFIXES:
        if spec.startswith(prefix):
            return spec[len(prefix):]
    return None

_SHOWN = 5
"""How many of the dropped rows a warning names."""


def join_jsonl_paths(specs: list[str]) -> list[str]:
    """``specs`` (dataset specs split at every comma) with the pieces that belong to a ``jsonl:`` path joined back
    to it, so that ``task.datasets=jsonl:/data/a,b.jsonl`` names the file ``/data/a,b.jsonl``.

    A piece that follows a ``jsonl:`` spec is joined to it (with the comma) when it is no dataset spec of its own
    (not a reasoning-gym name such as ``gcd`` and not ``jsonl:...``, e.g. ``b.jsonl``), or when the joined path is an
    existing file and the path before the comma is not. Otherwise the specs stay apart: ``jsonl:/data/a.jsonl,gcd``
    is a file and the gym dataset ``gcd``. The pieces are stripped of surrounding blanks, as the list they come
    from; a path whose own text around a comma holds blanks is best given as a YAML list (``datasets:
    ["jsonl:/data/a, b.jsonl"]`` in a recipe file), which is never split."""
    out: list[str] = []
    for spec in specs:
        prev = out[-1] if out else None
        if prev is not None and isinstance(prev, str) and isinstance(spec, str) and file_spec_path(prev) is not None:
            joined = f"{prev},{spec}"
            own_spec = file_spec_path(spec) is not None or _is_gym_name(spec)
            path, joined_path = Path(file_spec_path(prev)), Path(file_spec_path(joined))
            if not own_spec or (joined_path.is_file() and not path.is_file()):
                out[-1] = joined
                continue
        out.append(spec)
    return out


def _is_gym_name(spec: str) -> bool:
    """Whether ``spec`` spells a reasoning-gym dataset name (as ``TaskConfig`` accepts one)."""
    return re.fullmatch(r"[a-z][a-z0-9_]*", spec) is not None


def load_jsonl_problems(path: str | Path, source: str | None = None, *, prompt_key: str = "",
                        answer_key: str = "") -> list[Problem]:
    """All problems of a JSONL file, in file order; ``source`` defaults to ``"jsonl:" + path``; ``prompt_key`` /
    ``answer_key``: the keys ``task.jsonl_prompt_key`` / ``task.jsonl_answer_key`` name (empty: the usual ones,
    :mod:`megatron_logra.rewards.jsonl_rows`).

    Raises FileNotFoundError for a missing path, IsADirectoryError for a directory and ValueError
    (``PATH:LINE: ...``) for bytes that are not UTF-8, a malformed line (a key repeated within one
    object included), a repeated id or prompt (naming both lines) or a file without problems.
    """
    path = Path(path)
    source = source if source is not None else f"{JSONL_PREFIX}{path}"
    parquet = source.startswith(PARQUET_PREFIX)
    kind, example = ("Parquet", "problems.parquet") if parquet else ("JSONL", "problems.jsonl")
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a {kind} problem file (dataset spec {source!r}); "
                                f"name the file itself, e.g. {source.split(':', 1)[0]}:{path / example}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {kind} problem file not found (dataset spec {source!r})")
    problems: list[Problem] = []
    id_lines: dict[str, int] = {}
    prompt_lines: dict[str, tuple[int, str, str]] = {}  # by the whitespace-normalised prompt
    for line_no, obj in (parquet_rows(path) if parquet else json_lines(path)):
        where = f"{path}:{line_no}"
        problem = _problem_of(obj, source, where, line_no, prompt_key, answer_key)
        pid = problem.metadata["id"]
        if pid in id_lines:
            raise ValueError(f"{where}: id {pid!r} repeats line {id_lines[pid]}; ids must be unique (give one "
                             f"of the two rows another id)")
        key = same_prompt_key(problem.prompt)  # "What is  2+2? " repeats "What is 2+2?"
        if key in prompt_lines:
            first, answer, text = prompt_lines[key]
            what = ("with the same answer" if answer == problem.answer
                    else f"with another answer ({answer!r} there, {problem.answer!r} here)")
            spaced = "" if text == problem.prompt else " (the same text but for whitespace)"
            raise ValueError(f"{where}: the prompt repeats line {first}{spaced} {what}; each prompt may appear once "
                             f"(remove one of the two lines)")
        id_lines[pid] = line_no
        prompt_lines[key] = (line_no, problem.answer, problem.prompt)
        problems.append(problem)
    if not problems:
        raise ValueError(f"{path}: no problems (the file is empty)")
    logger.info("loaded %d problems from %s", len(problems), path)
    return problems


def _decided_once(decide: Callable[[], list[bool]], group: Any) -> list[bool]:
    """``decide()`` run once per row on ``group``'s rank 0 (the rows kept, in order) and given to every rank of
    ``group``; ``decide()`` itself without a group of several ranks. Its error, on rank 0, reaches every rank."""
    from megatron_logra.parallel import group_size

    if group_size(group) == 1:
        return decide()  # once per row: the parse may be slow (math-verify)
    from megatron_logra.rollout.driver import share_from_driver

    return list(share_from_driver(decide, group))


class JsonlSource:
    """A finite problem source over a JSONL file, or a Parquet one when ``source`` starts with ``parquet:``;
    ``problem(i)`` is the ``i % size``-th row's problem."""

    def __init__(self, path: str | Path, source: str | None = None, *, prompt_key: str = "",
                 answer_key: str = "") -> None:
        self.path = Path(path).expanduser()  # task.datasets=jsonl:~/data/x.jsonl: no shell expands that "~"
        self.name = source if source is not None else f"{JSONL_PREFIX}{path}"
        self.problems = load_jsonl_problems(self.path, self.name, prompt_key=prompt_key, answer_key=answer_key)
        self.size: int | None = len(self.problems)

    def drop_unparsable_answers(self, parses: Callable[[str], bool], group: Any = None) -> int:
        """Drop the rows whose gold answer ``parses`` (e.g. math-verify's parse, ``rewards.math.parses_as_math``)
        rejects, and return how many were dropped, logging one warning that names the file, the count and the
        first few lines with their answers. ``ValueError`` naming the file and the first lines when no row is left.

        ``group``: the ranks that build this source together (a process group, ``dist.group.WORLD``, or None:
        this rank alone; every rank of it must call). Only its rank 0 runs ``parses``; the others receive which
        rows it kept (over the group's gloo twin, :func:`~megatron_logra.parallel.cpu_group`), so every rank
        holds the same rows even where a parse gives another answer on another rank (math-verify's parse hitting
        its time limit on a loaded rank) -- the ranks index one list of problems and must agree on it.

        Dropped rather than refused, as RL trainers such as verl and slime filter the rows of a dataset they
        cannot use (overlong prompts, unparsable answers) with a log line: a large real dataset (MATH, DeepScaleR)
        usually holds a few answers written as prose or unusual LaTeX, and such a row could never be rewarded --
        every completion would score 0 against it, wasting its rollouts and diluting the advantages. Fix the answers
        (LaTeX math, e.g. ``\\frac{1}{2}``) or score the file with a ``task.reward`` plugin that reads them to keep
        them. The rows are dropped from the train and the held-out problems alike (one list serves both)."""
        keep = _decided_once(lambda: [bool(parses(p.answer)) for p in self.problems], group)
        if len(keep) != len(self.problems):  # the ranks read different files under one path
            raise ValueError(f"{self.path}: rank 0 read {len(keep)} rows of it and this rank {len(self.problems)}: "
                             f"every rank must see the same file")
        bad = [p for p, ok in zip(self.problems, keep) if not ok]
        if not bad:
            return 0
        shown = "; ".join(f"line {p.metadata['line']}: {p.answer[:80]!r}" for p in bad[:_SHOWN])
        more = f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        if len(bad) == len(self.problems):
            raise ValueError(f"{self.path}: math-verify cannot parse the gold answer of any of its {len(bad)} rows "
                             f"({shown}{more}), so no completion could be rewarded; write the answers as LaTeX math "
                             f"(e.g. \\frac{{1}}{{2}}) or score the file with a task.reward plugin "
                             f"(package.module:function)")
        self.problems = [p for p, ok in zip(self.problems, keep) if ok]
        self.size = len(self.problems)
        logger.warning("%s: skipping %d of %d rows whose gold answer math-verify cannot parse (no completion could "
                       "match it): %s%s; fix those answers or score the file with a task.reward plugin to keep them",
                       self.path, len(bad), len(bad) + len(self.problems), shown, more)
        return len(bad)

    def problem(self, raw_index: int) -> Problem:
        """The problem at ``raw_index % size`` (a shallow copy, so callers may edit it)."""
        p = self.problems[raw_index % len(self.problems)]
        return Problem(prompt=p.prompt, answer=p.answer, source=p.source, metadata=dict(p.metadata),
                       has_answer=p.has_answer, raw_answer=p.raw_answer)
