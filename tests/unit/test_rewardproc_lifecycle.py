"""``task.reward_workers``: the field's checks, and the workers' lifetime: started lazily, none left alive once
the pool is closed (also by a job that raises), at interpreter exit without a close, and when the trainer is
killed while a worker is stuck in C code.

Real worker processes of a real plugin written into ``tmp_path``; real subprocesses and signals; no mocks.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from megatron_logra.rewards import Problem, TaskConfig, build_task
from megatron_logra.rewards.process_pool import RewardProcessPool, closing_reward_workers

PLUGIN = '''
import re


def exact(problem, completion):
    """Exact match; "regex" backtracks for ever in C (holding the GIL)."""
    if completion == "regex":
        return 1.0 if re.match(r"(a+)+$", "a" * 40 + "b") else 0.0
    return 1.0 if completion.strip() == problem.answer else 0.0
'''

PROBLEM = Problem("What is 1 + 1?", "2", "chain_sum", {})


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    name = f"mlogra_rewardproc_life_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:exact"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (an orphan's exit status waits for whoever adopts it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return os.path.exists(f"/proc/{pid}") or not sys.platform.startswith("linux")


def _gone(pids: list[int], within_s: float) -> bool:
    end = time.monotonic() + within_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize("value", [-1, True, 1.5, "2", None])
def test_bad_reward_workers_are_refused_naming_the_field_and_the_fix(value):
    with pytest.raises(ValueError, match=r"task\.reward_workers=.*whole number of reward worker processes >= 0, "
                                         r"e\.g\. task\.reward_workers=4 \(0 scores the rewards in the trainer's"):
        TaskConfig(reward_workers=value)


def test_reward_workers_default_and_override():
    from megatron_logra.config.overrides import apply_overrides
    from megatron_logra.config.recipe_files import load_recipe

    assert TaskConfig().reward_workers == 0
    assert build_task(TaskConfig(num_eval=0)).pool is None  # the default scores in process, as before
    assert apply_overrides(load_recipe("tiny"), ["task.reward_workers=3"]).task.reward_workers == 3
    with pytest.raises(ValueError, match=r"task\.reward_workers=-2: give a whole number"):
        apply_overrides(load_recipe("tiny"), ["task.reward_workers=-2"])


def test_no_worker_is_left_alive_once_the_pool_is_closed(plugin):
    pool = RewardProcessPool(TaskConfig(reward=plugin, num_eval=0, reward_workers=2))
    assert pool.pids() == []
    assert pool.score_many([("chain_sum", PROBLEM, "2"), ("chain_sum", PROBLEM, "3")]) == [1.0, 0.0]
    pids = pool.pids()
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    clone = copy.deepcopy(pool)  # a copy has workers of its own, none started
    assert clone.pids() == []
    pool.close()
    assert pool.pids() == [] and not any(_alive(pid) for pid in pids)  # joined: not even zombies
    assert pool.score_many([("chain_sum", PROBLEM, "2")]) == [1.0]  # a later batch starts fresh workers
    assert not set(pool.pids()) & set(pids)
    pool.close()


def test_a_job_that_raises_closes_the_pools_it_started(plugin):
    outside = RewardProcessPool(TaskConfig(reward=plugin, num_eval=0, reward_workers=1))
    outside.score_many([("chain_sum", PROBLEM, "2")])
    started: list[int] = []

    @closing_reward_workers
    def job():
        pool = RewardProcessPool(TaskConfig(reward=plugin, num_eval=0, reward_workers=2))
        pool.score_many([("chain_sum", PROBLEM, "2")])
        started.extend(pool.pids())
        raise RuntimeError("the job failed")

    try:
        with pytest.raises(RuntimeError, match="the job failed"):
            job()
        assert len(started) == 2 and not any(_alive(pid) for pid in started)
        assert outside.pids() and all(_alive(pid) for pid in outside.pids())  # not the job's: left to its owner
    finally:
        outside.close()


def test_a_worker_that_cannot_build_its_scorer_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """The plugin imports in the trainer but not in a worker: each batch fails with the worker's error."""
    from megatron_logra.rl.step_guard import RewardError, score_rollouts

    name = f"mlogra_rewardproc_noimport_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent('''
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise ImportError("no sandbox in this process")


        def exact(problem, completion):
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task(TaskConfig(reward=f"{name}:exact", num_eval=0, reward_workers=2))
    try:
        for step in (1, 2):  # the next batch tries fresh workers, and fails the same way
            with pytest.raises(RewardError, match=rf"RL step {step}: the reward of sample 0 .*ValueError: reward "
                                                  rf"function '{name}:exact': importing module .*no sandbox in"):
                score_rollouts(task, [PROBLEM] * 3, ["2"] * 3, step=step)
            assert task.pool.pids() == []
    finally:
        task.close()


SCRIPT = '''
import sys
from megatron_logra.rewards import Problem, TaskConfig
from megatron_logra.rewards.process_pool import RewardProcessPool

pool = RewardProcessPool(TaskConfig(reward={plugin!r}, num_eval=0, reward_workers=2, reward_timeout_s=0))
problem = Problem("What is 1 + 1?", "2", "chain_sum", {{}})
assert pool.score_many([("chain_sum", problem, "2")]) == [1.0]
print(*pool.pids(), flush=True)
if sys.argv[1] == "hang":
    pool.score_many([("chain_sum", problem, "regex")])  # no limit: waits for ever
'''


def _script(plugin: str, tmp_path, how: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(SCRIPT.format(plugin=plugin)), how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_workers_end_with_the_interpreter_and_with_a_killed_trainer(plugin, tmp_path):
    # a script that exits without closing its pool: exits at once (nothing waits on the idle workers), none left
    exits, hangs = _script(plugin, tmp_path, "exit"), _script(plugin, tmp_path, "hang")
    try:
        out, err = exits.communicate(timeout=60)
        assert exits.returncode == 0, err
        pids = [int(p) for p in out.split()]
        assert len(pids) == 2 and _gone(pids, 5)
        # a trainer killed (SIGKILL: no exit handler runs) while a worker is stuck in C code: the kernel ends both
        pids = [int(p) for p in hangs.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids), hangs.stderr.read() if not pids else pids
        time.sleep(0.3)  # the regex is running
        hangs.send_signal(signal.SIGKILL)
        hangs.wait(10)
        assert _gone(pids, 5)
    finally:
        for proc in (exits, hangs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_reward_workers_is_a_launch_setting_of_a_recipe_resume():
    """Scoring in worker processes gives the same rewards as in process, so a bare ``--resume`` may change it; the
    reward itself may not change."""
    from megatron_logra.cli import resume_differences
    from megatron_logra.config import parse_args_to_config, to_dict

    saved = to_dict(parse_args_to_config("tiny", []))
    cfg = parse_args_to_config("tiny", ["task.reward_workers=2", "train.resume=true"])
    assert resume_differences(saved, cfg) == []
    cfg = parse_args_to_config("tiny", ["task.reward_workers=2", "task.wrong_reward=-1"])
    assert [name for name, _, _ in resume_differences(saved, cfg)] == ["task.wrong_reward"]
