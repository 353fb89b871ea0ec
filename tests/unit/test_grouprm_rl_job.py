"""A short ``tiny`` RL run launched with slime's ``--custom-rm-path ... --group-rm``: the function is called once per
prompt group with the group's samples (``rl.group_size`` in training, ``rl.rollout.eval_samples`` at the held-out
evaluation), every logged sample's reward is its place in the list the function returned, and the evaluation's
calls see its own completion cap (``--eval-max-response-len``). CPU, real components, no mocks."""

from __future__ import annotations

import importlib
import json

import pytest

from support.jsonl_rows import plugin_and_file, write_rows
from support.run_fixtures import SMALL_RL, run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

GROUP_RM = '''
CALLS = []


async def placed(args, samples):
    """Reward 2 x the sample's place in its group minus 1 (-1, 1, 3, ...); records each call."""
    CALLS.append(dict(n=len(samples), prompts=sorted({s.prompt for s in samples}), group_rm=args.group_rm,
                      eval_cap=args.eval_max_response_len, cap=args.rollout_max_response_len))
    return [2.0 * i - 1.0 for i in range(len(samples))]
'''


def test_a_tiny_run_scores_each_group_with_one_call(tmp_path, monkeypatch):
    name, data = plugin_and_file(tmp_path, monkeypatch, GROUP_RM, "mlogra_grouprm_job")
    bench = write_rows(tmp_path / "bench.jsonl", [("7+1=", "8"), ("8+1=", "9")])
    calls = importlib.import_module(name).CALLS
    run = tmp_path / "run"
    summary = run_rl_recipe("tiny", [
        *SMALL_RL, f"train.run_dir={run}", f"task.datasets=jsonl:{data}", f"task.eval_datasets={bench}",
        "--custom-rm-path", f"{name}.placed", "--group-rm", "--n-samples-per-prompt", "3",
        "--rollout-batch-size", "4", "--rollout-max-response-len", "5", "--eval-max-response-len", "9",
        "--n-samples-per-eval-prompt", "2", "rl.rollout.eval_temperature=1.0", "rl.eval_interval=1", "rl.steps=1",
        "rl.log_samples=12", "rl.micro_batch_size=12"])
    assert summary["steps"] == 1
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    train = [s for s in samples if s["split"] == "train"]
    assert [s["reward"] for s in train] == [-1.0, 1.0, 3.0] * 4  # each group's list, in order
    assert [s["correct"] for s in train] == [False, True, True] * 4  # reward >= task.correct_reward (1)
    evals = [s for s in samples if s["split"] == "eval"]
    assert evals and [s["reward"] for s in evals] == [-1.0, 1.0] * (len(evals) // 2)
    train_calls = [c for c in calls if c["n"] == 3]
    eval_calls = [c for c in calls if c["n"] == 2]
    assert len(train_calls) == 4 and len(eval_calls) == len(evals) // 2  # one call per problem and evaluation
    assert len(calls) == len(train_calls) + len(eval_calls)  # no call of another size
    assert all(len(c["prompts"]) == 1 and c["group_rm"] and c["cap"] == 5 and c["eval_cap"] == 9 for c in calls)
    assert {c["prompts"][0] for c in eval_calls} == {"7+1=", "8+1="}
