"""Math answers: final-answer extraction from a completion and equivalence checks with math-verify.

Extraction rule (:func:`extract_final_answer`), first match wins:

1. the content of the **last** ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. else the content of the last ``<answer>...</answer>``: rule 1 inside it, else rule 3 inside it,
   else, when the content is prose (two or more words of two or more letters that are neither
   LaTeX commands nor math words such as ``sqrt``, ``pi`` or ``and``), rule 4 inside it, else the
   content itself (``Evelyn``, ``x = 3``, ``\\frac{1}{2}``);
3. else the text after the last ``answer:`` / ``answer is`` / ``answer is:`` (case-insensitive) up to the end of
   that line (or the next non-empty line when that line is empty) or the first sentence end (a
   period followed by whitespace), and before the prose that may follow it outside brackets
   (:func:`_cut_trailing_prose`): a comma or semicolon followed by a lowercase word
   (``2, because 1+1=2`` gives ``2``) or a connective such as ``because`` / ``since``
   (``2 because ...``); ``1,000``, ``3.5``, ``(1, 2)``, ``x = 3, y = 4`` and ``1, 2, and 3`` stay whole;
4. else the last number in the text (integers, decimals, ``1,234`` thousands, ``a/b`` fractions,
   an optional leading minus sign unless it follows a letter, digit or ``)``);
5. else None (scored as wrong).

Answers from rules 2 and 3 lose a trailing period, Markdown emphasis and code marks around them
(``**42**``, ``*42*``, ``_42_``, `` `42` ``) and enclosing ``$...$``.

An extracted answer longer than :data:`MAX_ANSWER_CHARS` characters is rejected (None): sympy can
take unbounded time on adversarial input, and no reference answer is that long.

Equivalence (:func:`math_equal`): both strings are wrapped in ``\\boxed{...}`` and parsed with
``math_verify.parse`` (bare LaTeX such as ``\\frac{\\sqrt{3}}{2}`` is not found by math-verify
without an anchor; ``\\boxed`` is the strongest one); when that yields no sympy expression (only
strings, e.g. for ``**42**``) the unwrapped string is parsed instead and used if it gives one (or
when the boxed parse gave nothing at all). A *word answer* -- letters only, as words separated by single blanks,
hyphens or apostrophes, with one word of two or more letters that is not a math word (``yes``, ``Paris``, ``no
solution``; not ``x``, ``x y`` or ``pi``) -- is parsed as ``\\text{...}`` instead: math-verify reads a bare word as a
product of one-letter variables, under which every anagram is equal (``on`` = ``no``, ``sey`` = ``yes``); as text it
is one symbol, compared case-insensitively with blanks ignored (``New York`` = ``new york``). Then
``math_verify.verify(gold, pred)``.
math-verify 0.9.0 signatures: ``parse(pred, extraction_config=..., fallback_mode=...,
extraction_mode=..., parsing_timeout=5, raise_on_error=False)`` and ``verify(gold, target,
float_rounding=6, numeric_precision=15, strict=True, allow_set_relation_comp=False,
timeout_seconds=5, raise_on_error=False)``. Its timeouts use ``signal.alarm``, which raises off
the main thread; we therefore pass ``parsing_timeout=None, timeout_seconds=None`` whenever we are
not on the main thread (or the scorer's timeout is disabled).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

from megatron_logra.rewards.base import Problem, extract_tagged_answer

__all__ = [
    "MAX_ANSWER_CHARS",
    "MathVerifyScorer",
    "extract_boxed",
    "extract_final_answer",
    "math_equal",
    "parses_as_math",
]

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 512
"""Longest extracted answer that is handed to math-verify; longer ones score as wrong."""

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_MARKER_RE = re.compile(r"answer\s*(?::|is\b(?:\s*:)?)", re.IGNORECASE)  # "answer is:" too
_SENTENCE_END_RE = re.compile(r"\.\s")
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
_WORD_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]{2,}(?![A-Za-z])")
_MATH_WORDS = frozenset({
    "sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh",
    "log", "ln", "lg", "exp", "pi", "inf", "infty", "infinity", "mod", "gcd", "lcm", "max", "min", "and", "or",
})
_EMPHASIS = "*_`"
_PROSE_AFTER_COMMA_RE = re.compile(r"\s+([a-z][A-Za-z]*)(?=$|[\s,.;:!?])")
_CONNECTIVE_RE = re.compile(r"\s+([A-Za-z]+)(?=$|[\s,])")
_CONNECTIVES = frozenset({
    "because", "since", "as", "so", "which", "hence", "thus", "therefore", "given", "where", "when",
})
"""Words that end a marked answer when they follow it after a blank (``the answer is 2 because ...``)."""
_SHORT_PROSE_WORDS = frozenset({
    "so", "as", "if", "it", "is", "no", "we", "to", "by", "in", "at", "on", "of", "be", "do", "my", "an",
})
"""Two-letter words that are prose after a comma; other two-letter words (``xy``, ``ab``) may be variables."""
_OPENERS, _CLOSERS = "([{", ")]}"
_WORD_ANSWER_RE = re.compile(r"[A-Za-z]+(?:[ '-][A-Za-z]+)*")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces; None if none closes."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            ch = text[pos]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:pos].strip()
    return None


def _clean(candidate: str) -> str:
    """``candidate`` without a trailing period, Markdown emphasis / code marks around it and enclosing ``$...$``."""
    previous = None
    while candidate != previous:
        previous = candidate
        candidate = candidate.strip().rstrip(".").strip().strip(_EMPHASIS)
        if len(candidate) >= 2 and candidate.startswith("$") and candidate.endswith("$"):
            candidate = candidate.strip("$")
    return candidate.strip()


def _is_prose_word(word: str) -> bool:
    """Whether ``word`` (letters only) is an English word rather than a variable or a math word."""
    if word.lower() in _MATH_WORDS:
        return False
    return len(word) >= 3 or word.lower() in _SHORT_PROSE_WORDS


def _cut_trailing_prose(candidate: str) -> str:
    """``candidate`` up to the prose that follows its answer, outside any brackets.

    The cut falls before the first ``,`` or ``;`` (not the LaTeX space ``\\,``) that is followed by a
    lowercase prose word (:func:`_is_prose_word`), and before the first blank that is followed by a
    connective (:data:`_CONNECTIVES`). Commas between numbers (``1,000``), inside brackets (``(1, 2)``,
    ``\\{1, 2\\}``) or before a variable or math word (``x = 3, y = 4``, ``1, 2, and 3``) do not cut.
    """
    depth = 0
    for pos, ch in enumerate(candidate):
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth = max(0, depth - 1)
        elif depth:
            continue
        elif ch in ",;" and (pos == 0 or candidate[pos - 1] != "\\"):
            match = _PROSE_AFTER_COMMA_RE.match(candidate, pos + 1)
            if match and _is_prose_word(match.group(1)):
                return candidate[:pos]
        elif ch.isspace() and (pos == 0 or not candidate[pos - 1].isspace()):
            match = _CONNECTIVE_RE.match(candidate, pos)
            if match and match.group(1).lower() in _CONNECTIVES:
                return candidate[:pos]
    return candidate


def _after_marker(text: str) -> str | None:
    matches = list(_ANSWER_MARKER_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    lines = rest.split("\n")
    candidate = _clean(lines[0])
    if not candidate:
        candidate = next((_clean(line) for line in lines[1:] if _clean(line)), "")
    candidate = _clean(_cut_trailing_prose(_SENTENCE_END_RE.split(candidate, maxsplit=1)[0]))
    return candidate or None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _is_prose(text: str) -> bool:
    """Two or more words of two or more letters that are neither LaTeX commands nor math words."""
    words = _WORD_RE.findall(_LATEX_COMMAND_RE.sub(" ", text))
    return sum(word.lower() not in _MATH_WORDS for word in words) >= 2


def _tagged_answer(content: str) -> str:
    """The answer inside ``<answer>...</answer>`` content (rule 2 of the module docstring)."""
    boxed = extract_boxed(content)
    if boxed is not None:
        return boxed
    marked = _after_marker(content)
    if marked is not None:
        return marked
    content = _clean(content)
    if _is_prose(content):
        return _last_number(content) or content
    return content


def extract_final_answer(completion: str) -> str | None:
    """The final answer in ``completion`` by the module's rule (boxed > <answer> > "answer:" > last number)."""
    answer = extract_boxed(completion)
    if answer is None:
        tagged = extract_tagged_answer(completion)
        if tagged is not None:
            answer = _tagged_answer(tagged)
    if answer is None:
        answer = _after_marker(completion)
    if answer is None:
        answer = _last_number(completion)
    if answer is None or not answer.strip():
        return None
    if len(answer) > MAX_ANSWER_CHARS:
        logger.debug("extracted answer of %d chars exceeds MAX_ANSWER_CHARS; scored as wrong", len(answer))
        return None
    return answer.strip()


def _timeouts(timeout_s: int | None) -> tuple[int | None, int | None]:
    """(parsing_timeout, timeout_seconds) for math-verify: None off the main thread (signal.alarm)."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return None, None
    return timeout_s, timeout_s


def _is_word_answer(text: str) -> bool:
    """Whether ``text`` is a word answer (module docstring): letters in words, one of them a word of two or more
    letters that is no math word."""
    return _WORD_ANSWER_RE.fullmatch(text) is not None and any(
        len(word) >= 2 and word.lower() not in _MATH_WORDS for word in re.split(r"[ '-]", text))


def _parse(text: str, timeout_s: int | None) -> list[Any]:
    from math_verify import parse

    parsing_timeout, _ = _timeouts(timeout_s)
    if _is_word_answer(text):  # one text symbol, not a product of letters whose anagrams would all be equal
        return parse("\\boxed{\\text{" + text + "}}", parsing_timeout=parsing_timeout)
    parsed = parse("\\boxed{" + text + "}", parsing_timeout=parsing_timeout)
    if not any(_is_expression(p) for p in parsed):  # only strings (e.g. "**42**") or nothing
        unwrapped = parse(text, parsing_timeout=parsing_timeout)
        if unwrapped and (not parsed or any(_is_expression(p) for p in unwrapped)):
            parsed = unwrapped
    return parsed


def _is_expression(parsed: Any) -> bool:
    """Whether one item of a math-verify parse is a sympy object (the others are the matched strings)."""
    return not isinstance(parsed, str)


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str, timeout_s: int | None) -> tuple[Any, ...]:
    return tuple(_parse(text, timeout_s))


_PLAIN_NUMBER_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
"""A gold answer math-verify always parses (an integer or a decimal, e.g. GSM8K's and DAPO-Math's answers):
:func:`parses_as_math` says so without parsing it, which at a few milliseconds per row made loading a large file
slow."""


def parses_as_math(text: str, *, timeout_s: int | None = 5) -> bool:
    """Whether math-verify finds anything in the answer string ``text`` (as :func:`math_equal` parses a gold
    answer): a gold answer for which it is False is equivalent to no completion at all. A plain number is
    known to parse (:data:`_PLAIN_NUMBER_RE`)."""
    if _PLAIN_NUMBER_RE.fullmatch(text.strip()):
        return True
    return bool(_parse_gold(text, timeout_s))


_WARNED_GOLD: set[str] = set()
"""Gold answers math-verify could not parse that :func:`math_equal` has already warned about (once each)."""


def math_equal(gold: str, predicted: str, *, timeout_s: int | None = 5) -> bool:
    """Whether ``predicted`` is mathematically equivalent to ``gold`` according to math-verify.

    Both are answer strings (no surrounding prose), e.g. ``"\\frac{1}{2}"`` and ``"0.5"``. Unparsable
    input is not equivalent to anything. ``timeout_s`` bounds parsing and verification on the main
    thread; off the main thread, or with None, math-verify runs without a timeout.
    """
    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    from math_verify import verify

    gold_parsed = list(_parse_gold(gold, timeout_s))
    if not gold_parsed:
        if gold not in _WARNED_GOLD:  # once per answer, not at every completion scored against it
            _WARNED_GOLD.add(gold)
            logger.warning("math-verify could not parse the reference answer %r: no completion can match it",
                           gold[:200])
        return False
    pred_parsed = _parse(predicted, timeout_s)
    if not pred_parsed:
        return False
    _, verify_timeout = _timeouts(timeout_s)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))


class MathVerifyScorer:
    """Scores 1.0 when the final answer extracted from the completion equals ``problem.answer``.

    Binary: returns 1.0 or 0.0. Thread-safe (no timeouts off the main thread, see module doc).
    """

    def __init__(self, timeout_s: int | None = 5) -> None:
        if timeout_s is not None and timeout_s < 1:
            raise ValueError(f"timeout_s={timeout_s} must be >= 1 second or None (no timeout)")
        self.timeout_s = timeout_s

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 if ``extract_final_answer(completion)`` is equivalent to ``problem.answer``, else 0.0."""
        predicted = extract_final_answer(completion)
        if predicted is None:
            return 0.0
        return 1.0 if math_equal(problem.answer, predicted, timeout_s=self.timeout_s) else 0.0
