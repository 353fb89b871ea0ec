"""Word answers of a JSONL file (``yes``, ``no``, ``Paris``) scored with math-verify, the default reward of a
``jsonl:`` source: a bare word is compared as text, not as the product of its letters. math-verify alone reads
``yes`` as ``e*s*y``, so every anagram of a gold word (``sey``, ``on`` for ``no``) scored as correct.

The expected scores are those of a plain text comparison of the extracted answer with the gold answer (case and
blanks aside), written out by hand; math answers keep math-verify's equivalence."""

from __future__ import annotations

import json

import pytest

from megatron_logra.rewards import MathVerifyScorer, Problem, TaskConfig, build_task, math_equal


def _score(gold: str, completion: str) -> float:
    return MathVerifyScorer().score(Problem("Is it so?", gold, "jsonl:x", {}), completion)


@pytest.mark.parametrize("gold, completion", [
    ("yes", "The answer is sey."), ("no", "The answer is on."), ("Paris", "The answer is Psiar."),
    ("Evelyn", "<answer>nEvely</answer>"), ("New York", "\\boxed{\\text{York New}}"), ("no", "The answer is yes."),
])
def test_an_anagram_or_another_word_is_wrong(gold, completion):
    assert _score(gold, completion) == 0.0


@pytest.mark.parametrize("gold, completion", [
    ("yes", "The answer is yes."), ("yes", "The answer is Yes."), ("yes", "\\boxed{\\text{yes}}"),
    ("no", "answer: no"), ("Paris", "<answer>Paris</answer>"), ("New York", "The answer is new york."),
    ("\\text{Evelyn}", "<answer>Evelyn</answer>"), ("no solution", "\\boxed{\\text{No Solution}}"),
])
def test_the_same_word_is_right(gold, completion):
    assert _score(gold, completion) == 1.0


@pytest.mark.parametrize("gold, predicted, equal", [
    ("\\frac{1}{2}", "0.5", True), ("x", "x", True), ("A", "a", True), ("42", "42", True), ("42", "24", False),
    ("2x", "x \\cdot 2", True), ("\\text{(C)}", "C", True),
])
def test_math_answers_keep_math_verify_equivalence(gold, predicted, equal):
    assert math_equal(gold, predicted) is equal


def test_a_yes_no_file_trains_on_every_row_and_rewards_only_the_right_word(tmp_path):
    path = tmp_path / "yesno.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Is {i} even?", "answer": "yes" if i % 2 == 0 else "no"}) + "\n"
                            for i in range(40)), encoding="utf-8")
    task = build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=0))
    (source,) = task.sources
    assert len(source.problems) == 40  # word answers parse: no row is dropped as unparsable
    for problem in source.problems:
        other = "no" if problem.answer == "yes" else "yes"
        assert task.score(problem, f"The answer is {problem.answer}.") == (1.0, True)
        assert task.score(problem, f"The answer is {problem.answer[::-1]}.")[1] is False
        assert task.score(problem, f"The answer is {other}.")[1] is False
