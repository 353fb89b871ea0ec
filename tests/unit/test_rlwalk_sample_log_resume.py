"""A run resumed with ``rl.log_samples=0`` from a checkpoint before its last logged step: ``RUN/samples.jsonl`` keeps
no record of the steps after that checkpoint (they belong to a trajectory the resumed run replaces), as
``metrics.jsonl`` keeps none, instead of leaving the earlier process's later records behind."""

from __future__ import annotations

import json
import shutil

import pytest

from support.run_fixtures import run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

STEPS = ["rl.steps=3", "rl.eval_interval=0", "train.save_interval=2", "rl.group_size=2", "rl.prompts_per_step=4",
         "rl.micro_batch_size=8", "task.num_eval=4", "train.progress=false"]


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_without_sample_logging_drops_the_records_after_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    run_rl_recipe("tiny", [f"train.run_dir={run}", *STEPS, "rl.log_samples=2"])
    before = _lines(run / "samples.jsonl")
    assert {r["step"] for r in before if r["split"] == "train"} == {1, 2, 3}
    # back to the step-2 checkpoint (as after a kill between the two saves): step 3 is trained again, unlogged
    (run / "checkpoints" / "latest").write_text("step_00000002")
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    run_rl_recipe("tiny", [f"train.run_dir={run}", *STEPS, "rl.log_samples=0", "train.resume=true"])
    assert [r["step"] for r in _lines(run / "metrics.jsonl")] == [1, 2, 3]
    assert _lines(run / "samples.jsonl") == [r for r in before if r["step"] <= 2]
