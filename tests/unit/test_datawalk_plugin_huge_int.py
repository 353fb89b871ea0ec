"""A ``task.reward`` plugin returning an integer past float's range (``10**400``: a Python number, and far outside
``[0, 1]``) stops the RL step naming the plugin, as any value outside ``[0, 1]`` does; it raised a bare
``OverflowError: int too large to convert to float`` that named no plugin. Integers too long for ``repr`` (past
Python's 4300-digit limit) are named by their size. Values inside the range keep their score."""

from __future__ import annotations

import json
import uuid

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from megatron_logra.rl.step_guard import RewardError, score_rollouts

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
    name = f"mlogra_datawalk_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    return name, data


def _task(plugin, fn: str):
    name, data = plugin
    return build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"{name}:{fn}", num_eval=0))


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
