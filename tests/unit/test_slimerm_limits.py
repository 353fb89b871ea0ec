"""A slime reward function (``task.reward=slime:...``) under the reward machinery: an ``async`` function that hangs
is stopped by ``task.reward_timeout_s`` as any reward function is (on the main thread and off it), its event loop
is kept from call to call, and in reward worker processes (``task.reward_workers=1``) it gives the in-process
rewards, sees the RL job's ``args`` and is stopped at the limit too.

Real slime-style reward modules written into ``tmp_path``, real tasks, threads and worker processes; no mocks.
"""

from __future__ import annotations

import json
import struct
import time
import uuid

import pytest

from megatron_logra.rewards import RewardTimeout, TaskConfig, build_task
from megatron_logra.rl.step_guard import RewardError, score_rollouts
from support.threads import in_thread

SLIME_RM = '''
import asyncio
import os

LOOPS = []


async def hangs(args, sample):
    """Sleeps 10 s on the response "hang"; else 1 / -1 by the label, and records its event loop."""
    LOOPS.append(asyncio.get_running_loop())
    if sample.response == "hang":
        await asyncio.sleep(10)
    return 1.0 if sample.response.strip() == sample.label else -1.0


async def scaled(args, sample):
    """A graded reward on a scale of its own that uses args: exact 2.0, else a share by the group size."""
    if sample.response.strip() == sample.label:
        return 2.0
    return len(os.path.commonprefix([sample.response, sample.label])) / (3.0 * args.n_samples_per_prompt)
'''

ROWS = [("12+30=", "42"), ("5*5=", "25"), ("9-9=", "0"), ("100/4=", "25.0"), ("2**5=", "32"), ("7*6=", "42!")]


@pytest.fixture
def slime_module(tmp_path, monkeypatch):
    name = f"mlogra_slimerm_limits_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SLIME_RM)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn workers get the parent's sys.path
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in ROWS))
    return name, data


def _cfg(slime_module, fn: str, **kwargs) -> TaskConfig:
    name, data = slime_module
    return TaskConfig(datasets=[f"jsonl:{data}"], reward=f"slime:{name}:{fn}", num_eval=0, **kwargs)


def test_a_hanging_async_function_times_out_and_its_loop_is_kept(slime_module):
    import importlib

    loops = importlib.import_module(slime_module[0]).LOOPS
    task = build_task(_cfg(slime_module, "hangs", reward_timeout_s=1))
    (source,) = task.sources
    problems = list(source.problems)[:3]
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems, [problems[0].answer, "hang", "x"], step=6)
    assert time.monotonic() - start < 5  # stopped at the 1 s limit, not after the 10 s sleep
    message = str(err.value)
    assert message.startswith("RL step 6: the reward of sample 1") and "task.reward_timeout_s=1" in message
    assert f"slime:{slime_module[0]}:hangs" in message and isinstance(err.value.__cause__, RewardTimeout)
    # the next step is scored as usual, on the same event loop (a session a function keeps stays usable)
    loops.clear()
    assert score_rollouts(task, problems, [p.answer for p in problems], step=7) == [(1.0, True)] * 3
    assert len(loops) == 3 and len(set(map(id, loops))) == 1 and not loops[0].is_closed()
    assert not [t for t in __import__("asyncio").all_tasks(loops[0]) if not t.done()]  # the hung call was cancelled
    # off the main thread the call runs on a worker thread's own loop, under the same limit
    start = time.monotonic()
    with pytest.raises(RewardError, match="RewardTimeout"):
        in_thread(lambda: score_rollouts(task, problems, ["hang"], step=8))
    assert time.monotonic() - start < 5
    assert in_thread(lambda: score_rollouts(task, problems, ["x", problems[1].answer], step=9)) == [
        (-1.0, False), (1.0, True)]


def test_reward_workers_give_the_in_process_rewards_and_the_limit(slime_module):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rewards.slime_rm import with_run_args

    name, data = slime_module
    overrides = [f"task.datasets=jsonl:{data}", f"task.reward=slime:{name}.scaled", "task.num_eval=0",
                 "rl.group_size=4", "task.correct_reward=2"]
    cfg = parse_args_to_config("tiny", overrides)
    here = build_task(with_run_args(cfg.task, cfg.rl))
    cfg_w = parse_args_to_config("tiny", [*overrides, "task.reward_workers=1"])
    there = build_task(with_run_args(cfg_w.task, cfg_w.rl))
    try:
        (source,) = here.sources
        problems = list(source.problems)
        completions = [[p.answer, p.answer[:1] + "?", p.answer[:2] + "?"][i % 3] for i, p in enumerate(problems)]
        scored = score_rollouts(here, problems, completions, step=1)
        assert scored[0] == (2.0, True) and scored[1] == (1 / 12, False)  # the workers' args: n_samples_per_prompt 4
        assert scored[5] == (2 / 12, False) and len(set(scored)) == 3
        in_workers = score_rollouts(there, problems, completions, step=1)
        assert [struct.pack("<d", r) + bytes([c]) for r, c in in_workers] == \
            [struct.pack("<d", r) + bytes([c]) for r, c in scored]  # bit for bit
        assert there.pool is not None and len(there.pool.pids()) == 1
    finally:
        there.close()

    hung = build_task(_cfg(slime_module, "hangs", reward_timeout_s=1, reward_workers=1))
    try:
        (source,) = hung.sources
        problems = list(source.problems)[:2]
        assert score_rollouts(hung, problems, [problems[0].answer, "x"], step=2) == [(1.0, True), (-1.0, False)]
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            score_rollouts(hung, problems, ["x", "hang"], step=3)
        assert time.monotonic() - start < 8
        assert "the reward of sample 1" in str(err.value) and isinstance(err.value.__cause__, RewardTimeout)
    finally:
        hung.close()
