"""slime's ``--group-rm`` (``task.reward_group=true``): a reward function ``[async] rm(args, samples) -> list[float]``
is called once per prompt group with that group's samples, its list taken as their rewards in order; a list of
another length, a non-finite value or no list at all is a clear error naming the function; the reward time limit
bounds one group's call, in process and in a reward worker process, whose rewards are the in-process ones.

Real slime-style reward modules written into ``tmp_path``, real JSONL tasks, the RL step's own scoring; no mocks.
"""

from __future__ import annotations

import importlib
import struct
import time
import uuid

import pytest

from megatron_logra.rewards import RewardTimeout, TaskConfig, build_task
from megatron_logra.rl.step_guard import RewardError, score_rollouts
from support.jsonl_rows import write_rows

GROUP_RM = '''
import asyncio

CALLS = []


async def ranked(args, samples: "list[Sample]") -> "list[float]":
    """1 for a response equal to the label, plus 0.25 x its place in the group; records each call."""
    CALLS.append(dict(n=len(samples), prompts={s.prompt for s in samples}, group_rm=args.group_rm))
    await asyncio.sleep(0)
    return [float(s.response == s.label) + 0.25 * i for i, s in enumerate(samples)]


def plain(args, samples):
    """A plain def returning a tuple: the group's share of right answers, for every sample."""
    share = sum(s.response == s.label for s in samples) / len(samples)
    return tuple(share for _ in samples)


async def returns(args, samples):
    """Returns what the first response spells, evaluated with the group size as n."""
    return eval(samples[0].response, {"n": len(samples)})


async def hangs(args, samples):
    if any(s.response == "hang" for s in samples):
        await asyncio.sleep(10)
    return [1.0] * len(samples)


def per_sample(args, sample: "Sample") -> float:
    return 1.0
'''

ROWS = [("12+30=", "42"), ("5*5=", "25"), ("9-9=", "0"), ("2**5=", "32")]


@pytest.fixture
def group_module(tmp_path, monkeypatch):
    name = f"mlogra_grouprm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(GROUP_RM)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn workers get the parent's sys.path
    return name, write_rows(tmp_path / "rows.jsonl", ROWS)


def _task(group_module, fn: str, **kwargs):
    name, data = group_module
    return build_task(TaskConfig(datasets=[data], reward=f"slime:{name}:{fn}", num_eval=0, reward_group=True,
                                 correct_reward=1.0, **kwargs))


def _groups(task, size: int):
    """Each of the file's problems ``size`` times in a row, and completions: the answer at odd places."""
    (source,) = task.sources
    problems = [p for p in source.problems for _ in range(size)]
    return problems, [p.answer if i % 2 else "x" for i, p in enumerate(problems)]


def test_one_call_per_group_and_its_list_as_the_rewards(group_module):
    task = _task(group_module, "ranked")
    calls = importlib.import_module(group_module[0]).CALLS
    calls.clear()
    problems, completions = _groups(task, 3)
    scored = score_rollouts(task, problems, completions, step=1, group_size=3)
    # by hand: place i of a group earns 0.25 i, plus 1 where the completion is the answer (odd overall index)
    want = [float(k % 2) + 0.25 * (k % 3) for k in range(len(problems))]
    assert [r for r, _ in scored] == want and [c for _, c in scored] == [r >= 1.0 for r in want]
    assert calls == [dict(n=3, prompts={p.prompt}, group_rm=True) for p in problems[::3]]
    # a group of one (a greedy held-out problem): one call per completion
    calls.clear()
    assert score_rollouts(task, problems[:2], ["x", "x"], step="eval") == [(0.0, False), (0.0, False)]
    assert [c["n"] for c in calls] == [1, 1]
    # a plain def returning a tuple
    problems, completions = _groups(task, 2)
    share = score_rollouts(_task(group_module, "plain"), problems, completions, step=1, group_size=2)
    assert [r for r, _ in share] == [0.5] * len(problems)
    with pytest.raises(RewardError, match="samples 0..2 scored together answer different problems"):
        score_rollouts(task, problems[:6], completions[:6], step=1, group_size=3)


@pytest.mark.parametrize("spelled, error, what", [
    ("[1.0] * (n - 1)", ValueError, "returned 2 rewards for a group of 3 samples (task.reward_group=true, slime's "
                                    "--group-rm); expected one reward per sample"),
    ("[0.0, float('nan'), 1.0]", ValueError, "returned nan at index 1 of its list; expected a finite number"),
    ("[0.0, 'high', 1.0]", ValueError, "returned 'high' (str) at index 1 of its list"),
    ("1.0", TypeError, "returned 1.0 (float); with task.reward_group=true, slime's --group-rm it must return a list "
                       "of one reward per sample of the group (3 here)"),
    ("{'acc': [1.0] * n}", ValueError, "returned a dict (keys ['acc']); slime's --reward-key is not supported"),
])
def test_a_bad_list_is_a_clear_error_naming_the_function(group_module, spelled, error, what):
    task = _task(group_module, "returns")
    problems, _ = _groups(task, 3)
    completions = ["[1.0] * n"] * 3 + [spelled] * 3
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems[:6], completions, step=4, group_size=3)
    message = str(err.value)
    assert message.startswith("RL step 4: the reward of sample 3") and what in message, message  # the 2nd group
    assert f"slime:{group_module[0]}:returns" in message and isinstance(err.value.__cause__, error)


def test_the_config_and_the_slime_flag(group_module):
    from megatron_logra.config import parse_args_to_config

    name, data = group_module
    with pytest.raises(ValueError, match=r"task\.reward_group=true .* task\.reward='auto' is none: give "
                                         r"task\.reward=slime:package\.module:function"):
        TaskConfig(reward_group=True)
    with pytest.raises(ValueError, match=r"task\.reward_group='yes' must be true or false"):
        TaskConfig(reward="slime:a.b", reward_group="yes")
    with pytest.raises(ValueError, match=r"'sample' is annotated 'Sample', one sample, but task\.reward_group=true"):
        _task(group_module, "per_sample")
    cfg = parse_args_to_config("tiny", [f"task.datasets={data}", "--custom-rm-path", f"{name}.ranked", "--group-rm"])
    assert cfg.task.reward_group is True and cfg.task.reward == f"slime:{name}.ranked"
    assert parse_args_to_config("tiny", []).task.reward_group is False


def test_the_time_limit_bounds_a_group_in_process_and_in_a_worker(group_module):
    task = _task(group_module, "hangs", reward_timeout_s=1)
    problems, _ = _groups(task, 2)
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems[:4], ["a", "b", "c", "hang"], step=6, group_size=2)
    assert time.monotonic() - start < 5 and isinstance(err.value.__cause__, RewardTimeout)
    assert "RL step 6: the reward of sample 2" in str(err.value) and "task.reward_timeout_s=1" in str(err.value)

    here, there = _task(group_module, "ranked"), _task(group_module, "ranked", reward_workers=1)
    hung = _task(group_module, "hangs", reward_timeout_s=1, reward_workers=1)
    try:
        problems, completions = _groups(here, 3)
        want = score_rollouts(here, problems, completions, step=1, group_size=3)
        got = score_rollouts(there, problems, completions, step=1, group_size=3)
        assert [struct.pack("<d", r) + bytes([c]) for r, c in got] == \
            [struct.pack("<d", r) + bytes([c]) for r, c in want]  # bit for bit
        assert there.pool is not None and len(there.pool.pids()) == 1
        there.close()
        there = _task(group_module, "returns", reward_workers=1)
        with pytest.raises(RewardError, match="sample 3.*invalid literal"):  # raised in the worker
            score_rollouts(there, problems[:6], ["[1.0] * n"] * 3 + ["int('x')"] * 3, step=2, group_size=3)
        problems, _ = _groups(here, 2)
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            score_rollouts(hung, problems[:4], ["a", "b", "hang", "c"], step=3, group_size=2)
        assert time.monotonic() - start < 8 and isinstance(err.value.__cause__, RewardTimeout)
        assert "the reward of sample 2" in str(err.value)
    finally:
        there.close()
        hung.close()
