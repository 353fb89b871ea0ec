"""``megatron-logra eval RUN --ckpt-step N`` evaluates the checkpoint saved at step N (Megatron-LM's
``--ckpt-step``): its held-out value is the one the run itself measured at step N (``metrics.jsonl``), for the LM
and the RL job; a step without a complete checkpoint is refused naming the steps that have one."""

from __future__ import annotations

import json

import pytest

from support.cli import eval_ok as _eval, exit_2, one_process_cli  # noqa: F401
from support.run_fixtures import run_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _recorded(run, field: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[field] for r in records if r.get(field) is not None}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ckpt_step") / "lm"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=6", "train.save_interval=2", "train.eval_interval=2",
                           "train.keep_last=5", "train.progress=false"])
    return run


def test_each_saved_step_evaluates_to_what_the_run_measured_there(lm_run, capsys):
    recorded = _recorded(lm_run, "eval_loss")
    assert sorted(recorded) == [2, 4, 6]
    for step in (2, 4):
        _eval(lm_run, "--ckpt-step", str(step))
        out = json.loads(capsys.readouterr().out)
        assert out["step"] == step and out["eval_loss"] == pytest.approx(recorded[step], rel=1e-6)
    _eval(lm_run, "--ckpt-step=6")
    assert json.loads(capsys.readouterr().out)["eval_loss"] == pytest.approx(recorded[6], rel=1e-6)
    assert recorded[2] != pytest.approx(recorded[6], rel=1e-3)  # the steps are told apart


@pytest.mark.parametrize("args,match", [
    (["--ckpt-step", "3"], r"has no complete checkpoint of step 3: its checkpoints are at steps 2, 4, 6"),
    (["--ckpt-step", "two"], r"--ckpt-step 'two': give the step of a saved checkpoint"),
    (["--ckpt-step", "2", "--ckpt-step=4"], r"--ckpt-step is given twice"),
])
def test_a_step_without_a_checkpoint_is_refused(lm_run, capsys, args, match):
    import re

    err = exit_2(["eval", str(lm_run), *args], capsys)
    assert re.search(match, err), err


def test_an_rl_checkpoint_evaluates_to_the_accuracy_the_run_measured(tmp_path, capsys):
    run = tmp_path / "rl"
    run_recipe("tiny", [f"train.run_dir={run}", "rl.steps=4", "train.save_interval=2", "rl.eval_interval=2",
                        "train.keep_last=5", "rl.group_size=2", "rl.prompts_per_step=4", "rl.micro_batch_size=8",
                        "task.num_eval=16", "rl.rollout.eval_samples=2", "rl.rollout.eval_temperature=1.0",
                        "train.progress=false"])
    recorded = _recorded(run, "eval_accuracy")
    _eval(run, "--ckpt-step", "2")
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 2 and out["eval_accuracy"] == pytest.approx(recorded[2])
    assert out["eval_pass_at_k"] is not None
