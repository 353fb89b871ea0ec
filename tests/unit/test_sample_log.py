"""``rl.log_samples``: what the policy generated, in ``RUN/samples.jsonl``. Each step's first rollouts as trained on
(reward and correctness as the task scores the completion, the GRPO advantage of its group) and each held-out
evaluation's completions (step 0 before training); a resume from an earlier checkpoint leaves the same file as an
uninterrupted run."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest

from support.run_fixtures import run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

STEPS = ["rl.steps=3", "rl.eval_interval=2", "train.save_interval=2", "rl.log_samples=8", "rl.group_size=2",
         "rl.prompts_per_step=4", "rl.micro_batch_size=8", "task.num_eval=4", "rl.rollout.eval_samples=2",
         "rl.rollout.eval_temperature=1.0", "train.progress=false"]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    run = tmp_path_factory.mktemp("samples") / "run"
    summary = run_rl_recipe("tiny", [f"train.run_dir={run}", *STEPS])
    return run, summary


def test_each_step_and_evaluation_is_logged(logged):
    run, summary = logged
    records = _records(run)
    counts = Counter((r["step"], r["split"]) for r in records)
    # all 8 rollouts of each step; 2 samples of each of the 4 held-out problems before training, at step 2
    # (rl.eval_interval) and after the last
    assert counts == {(1, "train"): 8, (2, "train"): 8, (3, "train"): 8, (0, "eval"): 8, (2, "eval"): 8,
                      (3, "eval"): 8}
    assert all(("advantage" in r) == (r["split"] == "train") for r in records)
    final = [r for r in records if r["split"] == "eval" and r["step"] == 3]  # every held-out answer: the summary's
    assert summary["eval_accuracy_after"] == pytest.approx(sum(r["correct"] for r in final) / 8)
    solved = {r["prompt"] for r in final if r["correct"]}
    assert summary["eval_pass_at_k_after"] == pytest.approx(len(solved) / 4)


def test_rewards_and_advantages_match_an_independent_scoring(logged):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rewards import build_task

    task = build_task(parse_args_to_config("tiny", STEPS).task)
    problems = {p.prompt: p for p in task.eval_problems()}
    problems.update({p.prompt: p for p in (task.train_problem(i) for i in range(12))})  # the steps' prompts
    records = _records(logged[0])
    for r in records:
        problem = problems[r["prompt"]]
        assert (r["source"], r["answer"]) == (problem.source, problem.answer)
        reward, correct = task.score(problem, r["completion"])
        assert (r["reward"], r["correct"]) == (pytest.approx(reward), correct), r
        assert 0 < r["completion_tokens"] <= 6
    train = [r for r in records if r["split"] == "train"]
    for first, second in zip(train[0::2], train[1::2]):  # groups of 2: GRPO gives ±1, or 0 to equal rewards
        assert first["prompt"] == second["prompt"]
        gap = first["reward"] - second["reward"]
        want = 0.0 if gap == 0 else (1.0 if gap > 0 else -1.0)
        assert (first["advantage"], second["advantage"]) == (pytest.approx(want, abs=1e-4),
                                                              pytest.approx(-want, abs=1e-4))


def test_a_resume_from_an_earlier_checkpoint_leaves_an_uninterrupted_runs_file(logged, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(logged[0], run)
    (run / "checkpoints" / "latest").write_text("step_00000002")  # back to step 2: step 3 is trained again
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    run_rl_recipe("tiny", [f"train.run_dir={run}", *STEPS, "train.resume=true"])
    assert _records(run) == _records(logged[0])


def test_log_samples_is_checked():
    from megatron_logra.config import parse_args_to_config

    with pytest.raises(ValueError, match=r"rl\.log_samples=-1 must be a whole number >= 0"):
        parse_args_to_config("tiny", ["rl.log_samples=-1"])


def test_the_step_records_length_and_clip_ratio_of_the_logged_batch(logged):
    run, _ = logged
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    train = [r for r in _records(run) if r["split"] == "train"]
    for step in (1, 2, 3):
        batch = [r for r in train if r["step"] == step]  # the whole batch (one DP rank, 8 rollouts)
        assert metrics[step]["response_length"] == pytest.approx(sum(r["completion_tokens"] for r in batch) / 8)
        assert metrics[step]["response_clip_ratio"] == pytest.approx(sum(not r["finished"] for r in batch) / 8)
