"""A reward plugin that hangs on one rank stops the RL step on every rank, on a real gloo world of 2 processes.

Without ``task.reward_timeout_s`` the hung rank never reaches the step's next collective and the other rank waits
there until the process-group timeout; with it, the hung rank gives up after the limit, and ``score_rollouts``
raises the same ``RewardError`` (naming the step, the sample, the rank and the field) on both ranks within seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch.distributed as dist

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed

PLUGIN = '''
import time


def reward(problem, completion):
    if completion == "hang":
        time.sleep(120)  # far past task.reward_timeout_s and the test's timeouts
    return 1.0 if completion.strip() == problem.answer else 0.0
'''


def _worker(rank: int, world: int, out: str, plugin_dir: str, hung_rank: int) -> None:
    sys.path.insert(0, plugin_dir)
    from megatron_logra.rewards import TaskConfig, build_task
    from megatron_logra.rl.step_guard import RewardError, score_rollouts

    task = build_task(TaskConfig(dataset_kwargs={"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                               "max_digits": 1}},
                                 reward="timeout_ranks_plugin:reward", num_eval=0, reward_timeout_s=0.5))
    problems = [task.train_problem(2 * i + rank) for i in range(2)]
    completions = [problems[0].answer, "hang" if rank == hung_rank else problems[1].answer]
    start = time.monotonic()
    try:
        score_rollouts(task, problems, completions, step=5, dp_group=dist.group.WORLD)
        message = ""
    except RewardError as exc:
        message = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"message": message, "seconds": time.monotonic() - start}, fh)


def test_a_hung_reward_on_one_rank_stops_every_rank(tmp_path):
    hung_rank = 1
    (tmp_path / "timeout_ranks_plugin.py").write_text(PLUGIN)
    spawn_group(_worker, 2, tmp_path, str(tmp_path), str(tmp_path), hung_rank, timeout_s=60.0)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["message"] == got[1]["message"]
    message = got[0]["message"]
    assert message.startswith("RL step 5: the reward of sample 1 ")
    assert "task.reward_timeout_s=0.5" in message and message.endswith(f"(on data-parallel rank {hung_rank})")
    assert all(g["seconds"] < 20 for g in got)
