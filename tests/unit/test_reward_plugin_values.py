"""What a ``task.reward`` plugin may return: a real number in ``[0, 1]``, a bool as 0 / 1, and the one-element
numpy and torch values reward code naturally produces (``np.isclose(a, b)``, ``np.float32``, ``torch.tensor(1.)``)
as their ``.item()``. A numpy bool was refused before ("returned np.True_ (bool); expected a number"), though
bools count as 0 / 1; several values, strings and None stay refused, naming the plugin.

Real plugins written into ``tmp_path`` and imported by dotted path, scored through a real task and the RL step's
own scoring (``score_rollouts``); the expected rewards are the task's mapping of 0 / 1 / 0.5 written out."""

from __future__ import annotations

import pytest

from megatron_logra.rl.step_guard import RewardError, score_rollouts
from support.jsonl_rows import plugin_and_file, plugin_task

PLUGIN = '''
import numpy as np
import torch

def np_isclose(problem, completion):
    return np.isclose(float(problem.answer), float(completion))

def np_half(problem, completion):
    return np.float32(0.5)

def np_zero_d(problem, completion):
    return np.array(float(completion == problem.answer))

def torch_scalar(problem, completion):
    return torch.tensor(float(completion == problem.answer))

def torch_one_element(problem, completion):
    return torch.ones(1, 1)

def np_many(problem, completion):
    return np.array([1.0, 0.0])

def torch_many(problem, completion):
    return torch.zeros(3)

def a_string(problem, completion):
    return "1"
'''

CORRECT, WRONG = 1.0, -0.01  # TaskConfig's correct_reward / wrong_reward


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    return plugin_and_file(tmp_path, monkeypatch, PLUGIN, "mlogra_values_plugin")


def _task(plugin, fn: str):
    return plugin_task(plugin, fn)


@pytest.mark.parametrize("fn", ["np_isclose", "np_zero_d", "torch_scalar"])
def test_numpy_bools_and_one_element_values_are_their_number(plugin, fn):
    task = _task(plugin, fn)
    problem = task.sources[0].problems[3]  # answer "4"
    assert task.score(problem, "4") == (CORRECT, True)
    assert task.score(problem, "5") == (WRONG, False)
    scored = score_rollouts(task, [problem, problem], ["4", "5"], step=1)
    assert scored == [(CORRECT, True), (WRONG, False)]


def test_a_numpy_float_and_a_one_element_tensor_are_their_number(plugin):
    problem = _task(plugin, "np_half").sources[0].problems[0]
    assert _task(plugin, "np_half").score(problem, "x") == pytest.approx((WRONG + 0.5 * (CORRECT - WRONG), False))
    assert _task(plugin, "torch_one_element").score(problem, "x") == (CORRECT, True)


@pytest.mark.parametrize("fn, what", [("np_many", "ndarray of 2 values"), ("torch_many", "Tensor of 3 values"),
                                      ("a_string", "returned '1' \\(str\\)")])
def test_several_values_or_a_string_stop_the_step_naming_the_plugin(plugin, fn, what):
    task = _task(plugin, fn)
    problem = task.sources[0].problems[0]
    with pytest.raises(RewardError, match=rf"RL step 7: the reward of sample 0 .*{plugin[0]}:{fn}.* {what}"):
        score_rollouts(task, [problem], ["1"], step=7)
