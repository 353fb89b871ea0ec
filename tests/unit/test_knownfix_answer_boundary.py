"""A marked answer (``the answer is ...``) ends where the prose after it begins: ``2, because 1+1=2`` is the
answer ``2``, not ``2, because 1+1=2`` (which math-verify cannot read and scored as wrong). Answers that
themselves hold commas, periods or brackets stay whole. Scores are judged by math-verify itself."""

from __future__ import annotations

import pytest
from math_verify import parse, verify

from megatron_logra.rewards import MathVerifyScorer, Problem, extract_final_answer


def _verified(gold: str, answer: str) -> bool:
    """math-verify's own verdict on two answer strings, both boxed (its strongest anchor)."""
    return bool(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + answer + "}")))


# (completion, the answer a reader takes from it)
PROSE_AFTER_ANSWER = [
    ("... the answer is 2, because 1+1=2", "2"),
    ("So the answer is 2; since 1+1=2 we are done", "2"),
    ("The answer is 2 because 1+1=2", "2"),
    ("the answer is 2 since 3-1=2", "2"),
    ("The answer is \\frac{1}{2}, since x = 2y", "\\frac{1}{2}"),
    ("The answer is $\\frac{1}{2}$, which is 0.5", "\\frac{1}{2}"),
    ("The answer is (1, 2), as the two roots show", "(1, 2)"),
    ("The answer is 1,000, so we need 1,000 boxes", "1,000"),
    ("The answer is 3.5, as computed above", "3.5"),
    ("Answer: x = 3, so y = 4", "x = 3"),
    ("The answer is yes, because every term is positive", "yes"),
    ("The answer is [0, 1), as shown", "[0, 1)"),
]

# answers whose commas, periods and brackets belong to them
WHOLE_ANSWERS = [
    ("The answer is 1,000.", "1,000"),
    ("the answer is 3.5", "3.5"),
    ("The answer is (1, 2).", "(1, 2)"),
    ("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("Answer: x = 3, y = 4", "x = 3, y = 4"),
    ("answer: 1, 2, and 3", "1, 2, and 3"),
    ("The answer is \\{1, 2\\}.", "\\{1, 2\\}"),
    ("The answer is \\int x\\, dx.", "\\int x\\, dx"),
    ("The answer is Paris, France.", "Paris, France"),
    ("The answer is as follows: 5", "as follows: 5"),
]


@pytest.mark.parametrize("completion, answer", PROSE_AFTER_ANSWER + WHOLE_ANSWERS)
def test_marked_answer_stops_where_prose_begins(completion: str, answer: str) -> None:
    assert extract_final_answer(completion) == answer


@pytest.mark.parametrize("completion, answer", PROSE_AFTER_ANSWER)
def test_prose_after_a_right_answer_scores_right(completion: str, answer: str) -> None:
    """The reader's answer is the gold: math-verify accepts what is extracted, and the scorer gives 1.0."""
    scorer = MathVerifyScorer(timeout_s=5)
    assert _verified(answer, extract_final_answer(completion) or "")
    assert scorer.score(Problem(prompt="q", answer=answer, source="jsonl:x"), completion) == 1.0


def test_prose_after_a_wrong_answer_scores_wrong() -> None:
    """The cut does not let a number in the explanation stand in for the answer."""
    scorer = MathVerifyScorer(timeout_s=5)
    problem = Problem(prompt="q", answer="4", source="jsonl:x")
    assert scorer.score(problem, "The answer is 2, because 1+3=4") == 0.0
    assert scorer.score(problem, "The answer is 2 because 1+3=4") == 0.0
    assert scorer.score(problem, "The answer is 4, because 1+3=4") == 1.0


def test_math_verify_alone_reads_the_first_case_the_same_way() -> None:
    """math-verify's own extraction from the whole completion agrees on ``2`` (it is no oracle for the
    bracketed cases: it reads ``(1, 2)`` in prose as ``2``)."""
    assert verify(parse("\\boxed{2}"), parse("... the answer is 2, because 1+1=2"))
    assert extract_final_answer("... the answer is 2, because 1+1=2") == "2"
