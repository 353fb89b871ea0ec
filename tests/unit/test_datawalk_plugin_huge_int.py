"""A ``task.reward`` plugin returning an integer past float's range (``10**400``: a Python number, and far outside
``[0, 1]``) stops the RL step naming the plugin, as any value outside ``[0, 1]`` does; it raised a bare
``OverflowError: int too large to convert to float`` that named no plugin. Integers too long for ``repr`` (past
Python's 4300-digit limit) are named by their size. Values inside the range keep their score."""

from __future__ import annotations

import pytest

from megatron_logra.rl.step_guard import RewardError, score_rollouts
from support.jsonl_rows import plugin_and_file, plugin_task

PLUGIN = '''
def huge(problem, completion):
    return 10 ** 400

def enormous(problem, completion):
    return -(10 ** 5000)

def two(problem, completion):
    return 2

def one(problem, completion):
    return 1
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    return plugin_and_file(tmp_path, monkeypatch, PLUGIN, "mlogra_datawalk_plugin")


def _task(plugin, fn: str):
    return plugin_task(plugin, fn)


@pytest.mark.parametrize("fn, shown", [("huge", "about 401 digits"), ("enormous", "about 5001 digits"),
                                       ("two", "returned 2.0")])
def test_an_integer_outside_the_range_stops_the_step_naming_the_plugin(plugin, fn, shown):
    task = _task(plugin, fn)
    problem = task.sources[0].problems[0]
    with pytest.raises(RewardError) as exc:
        score_rollouts(task, [problem], ["1"], step=3)
    message = str(exc.value)
    assert message.startswith("RL step 3: the reward of sample 0"), message
    assert f"{plugin[0]}:{fn}" in message and "expected a number in [0, 1]" in message, message
    assert shown in message, message
    assert "OverflowError" not in message, message


def test_an_integer_inside_the_range_is_its_score(plugin):
    task = _task(plugin, "one")
    problem = task.sources[0].problems[0]
    assert score_rollouts(task, [problem], ["x"], step=1) == [(1.0, True)]
