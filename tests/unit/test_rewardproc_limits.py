"""``task.reward_workers``: a reward call that C code keeps from returning (a catastrophic regex backtrack, which
no limit interrupts in the trainer's process) is stopped at ``task.reward_timeout_s`` by killing its worker, with
the timeout outcome the RL step gives today (a ``RewardError`` caused by ``RewardTimeout``); a function that ends
or crashes its process gives an error naming the function and how the process ended; the pool goes on with fresh
workers either way.

A real plugin module written into ``tmp_path``, real worker processes, real signals; no mocks.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from megatron_logra.rewards import RewardTimeout, TaskConfig, build_task
from megatron_logra.rewards.process_pool import RewardWorkerDied
from megatron_logra.rl.step_guard import RewardError, score_rollouts

TINY_SUM = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
LIMIT_S = 1.0

PLUGIN = '''
import ctypes
import os
import re

PIDS = {pids!r}


def misbehaves(problem, completion):
    """Exact match; "regex" backtracks for ever in C (2**40 steps, holding the GIL; its process id is written to
    PIDS first), "exit" ends the process, "segfault" crashes it."""
    if completion == "regex":
        with open(PIDS, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        return 1.0 if re.match(r"(a+)+$", "a" * 40 + "b") else 0.0
    if completion == "exit":
        os._exit(3)
    if completion == "segfault":
        ctypes.string_at(0)
    return 1.0 if completion.strip() == problem.answer else 0.0
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    return tmp_path_factory.mktemp("rewardproc_limits")


@pytest.fixture(scope="module")
def task(where):
    name = f"mlogra_rewardproc_limits_{uuid.uuid4().hex[:8]}"
    (where / f"{name}.py").write_text(PLUGIN.format(pids=str(where / "regex_pids.txt")))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(where))
        task = build_task(TaskConfig(dataset_kwargs=TINY_SUM, reward=f"{name}:misbehaves", num_eval=0,
                                     reward_timeout_s=LIMIT_S, reward_workers=2))
        try:
            yield task
        finally:
            task.close()


@pytest.fixture(scope="module")
def problems(task):
    return [task.train_problem(i) for i in range(4)]


def _answers(problems):
    return [p.answer for p in problems]


def test_a_catastrophic_regex_is_stopped_at_its_limit_and_the_next_call_works(task, problems, where):
    assert score_rollouts(task, problems, _answers(problems), step=1) == [(1.0, True)] * 4  # workers started
    (where / "regex_pids.txt").write_text("")
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems, [problems[0].answer, "regex", "x", problems[3].answer], step=7)
    took = time.monotonic() - start
    assert LIMIT_S <= took < LIMIT_S + 3, took
    message = str(err.value)
    assert message.startswith("RL step 7: the reward of sample 1 (source 'chain_sum'"), message
    assert "RewardTimeout" in message and "task.reward_timeout_s=1" in message and ":misbehaves'" in message
    assert "was killed and replaced" in message
    assert isinstance(err.value.__cause__, RewardTimeout)
    killed = [int(pid) for pid in (where / "regex_pids.txt").read_text().split()]
    assert len(killed) == 1 and not _alive(killed[0]) and killed[0] not in task.pool.pids(), (killed, task.pool.pids())
    # the fresh worker scores the next step
    assert score_rollouts(task, problems, _answers(problems), step=8) == [(1.0, True)] * 4
    assert len(task.pool.pids()) == 2


@pytest.mark.parametrize("completion, how", [("exit", "it exited with code 3"),
                                             ("segfault", "it was killed by signal SIGSEGV (11)")])
def test_a_function_that_ends_its_process_is_a_clear_error_and_the_pool_recovers(task, problems, completion, how):
    score_rollouts(task, problems, _answers(problems), step=1)
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems, [problems[0].answer, problems[1].answer, completion, "x"], step=5)
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert message.startswith("RL step 5: the reward of sample 2 (source 'chain_sum'"), message
    assert "RewardWorkerDied" in message and ":misbehaves' ended its reward worker process" in message
    assert how in message and "while scoring" in message
    assert isinstance(err.value.__cause__, RewardWorkerDied)
    assert score_rollouts(task, problems, _answers(problems), step=6) == [(1.0, True)] * 4


def test_the_first_failing_sample_is_reported_as_in_process(task, problems):
    """Sample 1 times out, sample 2 (already running on the other worker) exits: sample 1 is the step's error."""
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems, [problems[0].answer, "regex", "exit", "x"], step=9)
    assert str(err.value).startswith("RL step 9: the reward of sample 1 ") and "RewardTimeout" in str(err.value)
    assert score_rollouts(task, problems, _answers(problems), step=10) == [(1.0, True)] * 4
