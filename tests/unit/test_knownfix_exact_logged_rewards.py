"""The rewards an RL step logs are the task's rewards exactly: ``task.wrong_reward=-0.005`` is logged as ``-0.005``
in ``samples.jsonl`` (it was logged through float32, as ``-0.004999999888241291``), and ``reward_mean`` in
``metrics.jsonl`` is the mean of those floats. A real ``tiny`` run with a reward plugin over a JSONL file."""

from __future__ import annotations

import json

import pytest

from support.jsonl_rows import plugin_and_file
from support.run_fixtures import run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

PLUGIN = '''
def odd_answer(problem, completion):
    """1 for a problem of odd answer, else 0: both outcomes occur whatever the model writes."""
    return float(int(problem.answer) % 2)
'''

CORRECT, WRONG = 0.7, -0.005
"""Neither is a float32 value: float32 turns them into 0.699999988079071 and -0.004999999888241291."""


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logged_rewards_are_the_tasks_floats(tmp_path, monkeypatch):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rewards import build_task

    name, data = plugin_and_file(tmp_path, monkeypatch, PLUGIN, "mlogra_knownfix_rewards")
    run = tmp_path / "run"
    overrides = [f"task.datasets=jsonl:{data}", f"task.reward={name}:odd_answer", f"task.correct_reward={CORRECT}",
                 f"task.wrong_reward={WRONG}", "task.num_eval=0", "rl.steps=2", "rl.log_samples=8",
                 "rl.group_size=2", "rl.prompts_per_step=4", "rl.micro_batch_size=8", "train.progress=false"]
    run_rl_recipe("tiny", [f"train.run_dir={run}", *overrides])

    task = build_task(parse_args_to_config("tiny", overrides).task)
    problems = {p.prompt: p for p in (task.train_problem(i) for i in range(8))}  # the two steps' prompts
    assert {int(p.answer) % 2 for p in problems.values()} == {0, 1}
    samples = [r for r in _lines(run / "samples.jsonl") if r["split"] == "train"]
    assert len(samples) == 16
    for r in samples:
        reward, correct = task.score(problems[r["prompt"]], r["completion"])
        assert r["reward"] == reward and r["correct"] == correct, r  # exactly, not to float32 precision
        assert r["reward"] == (CORRECT if int(problems[r["prompt"]].answer) % 2 else WRONG), r
    assert {r["reward"] for r in samples} == {CORRECT, WRONG}  # both outcomes logged

    metrics = _lines(run / "metrics.jsonl")
    for record in metrics:
        step = [r["reward"] for r in samples if r["step"] == record["step"]]  # every rollout of the step
        assert record["reward_mean"] == pytest.approx(sum(step) / len(step), rel=1e-15, abs=0)
