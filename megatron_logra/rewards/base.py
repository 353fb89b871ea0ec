"""Core types of the reward layer: problems, scorers, problem sources and stable hashing.

Contracts shared by every module of ``megatron_logra.rewards``:

* A :class:`Problem` is plain data (prompt text, reference answer, the name of the source that
  produced it, and source-specific metadata). It is what the rollout layer formats into a prompt
  and what a scorer receives back with the model's completion.
* A :class:`Scorer` maps ``(problem, completion)`` to a score in ``[0, 1]`` (1 = fully correct);
  turning that score into an RL reward is the :class:`~megatron_logra.rewards.task.Task`'s job.
* A :class:`ProblemSource` produces problems by *raw index*: procedural sources
  (``size is None``) are infinite and pure functions of the index, finite sources (JSONL files)
  hold ``size`` problems.
* A :class:`PromptFilter` says which prompts fit a completion length cap (the RL job's length rule), and
  which field's cap a refused prompt's warning names.
* :func:`stable_hash` is the only hash used for sampling and for the train/eval partition: it is
  blake2b over a canonical encoding, so it is identical in every process, on every machine and
  independent of ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

__all__ = [
    "Problem",
    "ProblemSource",
    "PromptFilter",
    "Scorer",
    "extract_tagged_answer",
    "prompt_bucket",
    "same_prompt_key",
    "stable_hash",
    "unit_uniform",
]

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


@dataclass
class Problem:
    """One task instance: what the policy is asked and how its answer is checked."""

    prompt: str
    """The question text exactly as the source produced it (no chat template applied)."""
    answer: str
    """Reference answer (for reasoning-gym: the dataset's oracle answer string, which may be ``""``)."""
    source: str
    """Name of the source that produced it: a reasoning-gym name or ``jsonl:PATH``; selects the scorer."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Source-specific data the scorer may need (reasoning-gym's entry metadata, JSONL ids, ...)."""
    has_answer: bool = True
    """False when the source has no single reference answer (reasoning-gym items whose oracle is None:
    graph_color, boxnet, ...); ``answer`` is then ``""``. An empty ``answer`` with ``has_answer=True``
    is a real answer: the empty string."""
    raw_answer: Any = None
    """The reference answer as a file row gave it where that is not its text: a JSON number (``42`` for the
    ``answer`` ``"42"``); None otherwise. Scorers read ``answer``; a slime reward function receives this as
    ``sample.label``, as slime passes the row's JSON value."""


@dataclass(frozen=True)
class PromptFilter:
    """Which prompts fit a completion length cap: ``fits(prompt)``, a pure function of the prompt text (the same on
    every DP rank, so every rank draws the same problems); ``describe(prompt)``, why a refused one does not fit (for
    warnings and errors); ``limit``, the field of the cap it leaves room for, which a warning names as the fix;
    ``fix``, what that warning says keeps the refused prompts instead, where it is not to raise ``model.seq_length``
    or lower ``limit`` (a cap on the prompt itself: ``task.eval_max_prompt_tokens``)."""

    fits: Callable[[str], bool]
    describe: Optional[Callable[[str], str]] = None
    limit: str = "rl.rollout.max_new_tokens"
    fix: str = ""


@runtime_checkable
class Scorer(Protocol):
    """Scores a completion for a problem: a float in ``[0, 1]``, 1.0 meaning correct."""

    def score(self, problem: Problem, completion: str) -> float:
        """Score ``completion`` (the generated text only, without the prompt) for ``problem``."""
        ...


@runtime_checkable
class ProblemSource(Protocol):
    """Produces problems by raw index; pure function of the index (and the source's own seed)."""

    name: str
    """Source name; equals ``Problem.source`` of every problem it produces."""
    size: int | None
    """Number of distinct raw indices for finite sources; None for infinite procedural ones."""

    def problem(self, raw_index: int) -> Problem:
        """The problem at ``raw_index`` (``0 <= raw_index < size`` for finite sources)."""
        ...


def stable_hash(*parts: Any) -> int:
    """64-bit blake2b hash of ``parts`` (each rendered with ``repr``); identical across processes."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = repr(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return int.from_bytes(h.digest(), "little") & _MASK64


def unit_uniform(*parts: Any) -> float:
    """A number in ``[0, 1)`` that is a pure function of ``parts`` (53 bits of :func:`stable_hash`)."""
    return (stable_hash(*parts) >> 11) / float(1 << 53)


def prompt_bucket(prompt: str, modulus: int) -> int:
    """Partition bucket of a prompt: ``hash(prompt text) % modulus`` (bucket 0 is eval-only).

    Depends on the prompt text alone (not on seeds, sources or indices), so every source and
    every run agree on which prompts are held out.
    """
    if modulus < 1:
        raise ValueError(f"modulus={modulus} must be >= 1")
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"mlogra-eval")
    return int.from_bytes(digest.digest(), "little") % modulus


def same_prompt_key(prompt: str) -> str:
    """``prompt`` with its whitespace normalised (stripped, every run of whitespace one blank): the form in which two
    prompts count as the same prompt (a ``jsonl:`` file's repeated prompt, a benchmark's held-out prompt that
    training skips). The text the model sees is unchanged; the ``task.eval_modulus`` split hashes the text as is."""
    return " ".join(prompt.split())


_TAG_RE_CACHE: dict[str, re.Pattern[str]] = {}


def extract_tagged_answer(completion: str, tag: str = "answer") -> str | None:
    """Content of the *last* ``<tag>...</tag>`` pair in ``completion``, stripped; None if absent."""
    pattern = _TAG_RE_CACHE.get(tag)
    if pattern is None:
        pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
        _TAG_RE_CACHE[tag] = pattern
    matches = pattern.findall(completion)
    if not matches:
        return None
    return matches[-1].strip()
