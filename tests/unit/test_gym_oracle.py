"""reasoning-gym oracles through GymSource / GymScorer agree with reasoning-gym's own score_answer,
also when the real oracle is the empty string (``ab`` items that reduce to the empty program) and
when there is no oracle at all (answer None)."""

from __future__ import annotations

import pytest

from megatron_logra.rewards.gym import GymScorer, GymSource


def _first(source: GymSource, predicate, limit: int = 2000) -> int:
    return next(i for i in range(limit) if predicate(source.dataset[i]))


def test_an_empty_oracle_answer_is_a_real_answer():
    source = GymSource("ab", seed=17)
    scorer = GymScorer(source.dataset, "ab")
    i = _first(source, lambda entry: entry["answer"] == "")
    entry = source.dataset[i]
    problem = source.problem(i)
    own = float(source.dataset.score_answer(answer="", entry=entry))
    assert own == 1.0
    assert scorer.score(problem, "<answer></answer>") == own
    assert scorer.score(problem, "The program reduces to nothing.\n<answer> </answer>") == own
    assert problem.answer == "" and problem.has_answer
    wrong = float(source.dataset.score_answer(answer="A# #A", entry=entry))
    assert scorer.score(problem, "<answer>A# #A</answer>") == wrong < 1.0


@pytest.mark.parametrize("name", ["ab", "chain_sum"])
def test_non_empty_oracles_score_as_reasoning_gym_scores_them(name):
    source = GymSource(name, seed=5)
    scorer = GymScorer(source.dataset, name)
    for i in range(5):
        entry, problem = source.dataset[i], source.problem(i)
        assert problem.has_answer and problem.answer == str(entry["answer"])
        assert scorer.score(problem, f"<answer>{entry['answer']}</answer>") == float(
            source.dataset.score_answer(answer=entry["answer"], entry=entry)) == 1.0


def test_a_missing_oracle_is_passed_back_as_none():
    source = GymSource("graph_color", seed=3)
    scorer = GymScorer(source.dataset, "graph_color")
    entry, problem = source.dataset[0], source.problem(0)
    assert entry["answer"] is None and problem.answer == "" and not problem.has_answer
    for completion in ["<answer></answer>", "<answer>{}</answer>"]:
        answer = completion.removeprefix("<answer>").removesuffix("</answer>")
        assert scorer.score(problem, completion) == min(1.0, max(0.0, float(
            source.dataset.score_answer(answer=answer, entry=entry))))
    copy = GymSource("graph_color", seed=3).problem(0)
    assert copy.has_answer is False
