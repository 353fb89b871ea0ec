"""``task.reward_workers``: a batch whose call fails returns that failure at once, as scoring in process stops at
the first failing call, instead of waiting for calls after it that other workers are still running (forever
with ``task.reward_timeout_s=0``). A real plugin module in ``tmp_path``, real worker processes; no mocks."""

from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

from megatron_logra.rewards import TaskConfig
from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.process_pool import RewardProcessPool

PLUGIN = '''
import os
import time

BARRIER = {barrier!r}


def score(problem, completion):
    if completion == "barrier":  # returns once two workers are in such a call together: both are ready
        open(os.path.join(BARRIER, str(os.getpid())), "w").close()
        end = time.monotonic() + 20
        while time.monotonic() < end and len(os.listdir(BARRIER)) < 2:
            time.sleep(0.01)
        return 1.0
    if completion == "fail":
        raise ValueError("this answer cannot be scored")
    time.sleep(float(completion))
    return 1.0
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    name = f"rewardreview_{uuid.uuid4().hex[:8]}"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(barrier=str(barrier)))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{name}:score"
    sys.modules.pop(name, None)


def test_a_failing_call_is_returned_without_waiting_for_later_calls_in_flight(plugin):
    pool = RewardProcessPool(TaskConfig(reward=plugin, num_eval=0, reward_workers=2, reward_timeout_s=0))
    problem = Problem(prompt="q", answer="a", source="chain_sum")
    try:
        assert pool.score_many([("chain_sum", problem, "barrier")] * 2) == [1.0, 1.0]  # both workers ready
        before = set(pool.pids())
        start = time.monotonic()
        outcomes = pool.score_many([("chain_sum", problem, "fail"), ("chain_sum", problem, "10")])
        assert time.monotonic() - start < 5, "the batch waited for the call after its failure"
        assert isinstance(outcomes[0], ValueError) and "cannot be scored" in str(outcomes[0])
        assert outcomes[1] is None  # not scored, as in process
        # the worker of the abandoned call was replaced; the pool scores on
        assert len(before - set(pool.pids())) == 1
        assert pool.score_many([("chain_sum", problem, "0")] * 3) == [1.0] * 3
        gone = before - set(pool.pids())
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in gone)
    finally:
        pool.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
