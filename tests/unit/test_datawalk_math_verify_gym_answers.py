"""``task.reward=math_verify`` on a reasoning-gym dataset without a single oracle answer (``graph_color``,
``propositional_logic``: reasoning-gym gives ``answer=None``) scored every completion 0 without a word, so the run
trained on nothing but zero advantages; it is refused at start naming the dataset, as a JSONL file of only
unparsable gold answers is. Datasets whose oracles math-verify parses keep working, their oracle scoring 1."""

from __future__ import annotations

import pytest
import reasoning_gym
from math_verify import parse

from megatron_logra.rewards import TaskConfig, build_task


@pytest.mark.parametrize("name", ["graph_color", "propositional_logic"])
def test_a_dataset_without_oracle_answers_is_refused_under_math_verify(name):
    items = [reasoning_gym.create_dataset(name, seed=0, size=8)[i] for i in range(8)]
    assert all(item["answer"] is None for item in items)  # the reference: nothing math-verify could compare with
    with pytest.raises(ValueError, match=rf"task.reward=math_verify: reasoning-gym dataset '{name}'.*task.reward=auto"):
        build_task(TaskConfig(datasets=["chain_sum", name], reward="math_verify", num_eval=4))


def test_the_same_dataset_under_its_own_scorer_is_accepted():
    build_task(TaskConfig(datasets=["graph_color"], reward="auto", num_eval=4))


@pytest.mark.parametrize("name", ["chain_sum", "gcd", "spell_backward"])
def test_datasets_with_parsable_oracles_still_build_and_reward_their_oracle(name):
    task = build_task(TaskConfig(datasets=[name], reward="math_verify", num_eval=4))
    problem = task.train_problem(0)
    assert parse(f"\\boxed{{{problem.answer}}}")  # math-verify itself reads this oracle
    assert task.score(problem, f"The answer is \\boxed{{{problem.answer}}}.") == (1.0, True)
