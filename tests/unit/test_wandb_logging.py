"""Weights & Biases logging (``--wandb-project``, ``train.wandb_*``): what W&B records, read back from its
offline transaction log (``tests/support/wandb_records.py``), equals ``metrics.jsonl``; ``--resume`` continues
the same W&B run and a new run starts another without deleting the old one's files; a missing ``wandb``
package and inconsistent settings are refused before anything is built."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_logra.cli import main
from megatron_logra.config.train import TrainConfig
from tests.support.cli import exit_2

pytest.importorskip("wandb")
from tests.support.wandb_records import offline_runs, read_offline_run  # noqa: E402 - needs wandb

LM_SMALL = ["train.progress=false", "train.eval_sequences=4", "train.save_interval=2", "train.eval_interval=2",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _jsonl(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _logged(history, key):
    return {h["step"]: h[key] for h in history if key in h}


def test_the_wandb_run_holds_the_step_records_config_and_summary(tmp_path, capsys, one_thread, offline):
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=4", *LM_SMALL,
                 "--wandb-project", "logra-tests", "--wandb-exp-name", "tiny-lm"]) == 0
    capsys.readouterr()
    (files,) = offline_runs(run)
    logged = read_offline_run(files)
    run_id = (run / "wandb_run_id").read_text().strip()
    assert logged["id"] == run_id and files.name.endswith(run_id)
    assert logged["project"] == "logra-tests" and logged["name"] == "tiny-lm"
    records = _jsonl(run)
    summary = json.loads((run / "summary.json").read_text())
    assert [h["step"] for h in logged["history"]] == [0] + [r["step"] for r in records] == [0, 1, 2, 3, 4]
    # step 0: the held-out loss before training, in W&B and TensorBoard (metrics.jsonl holds step records only)
    assert logged["history"][0]["eval_loss"] == pytest.approx(summary["eval_loss_before"])
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval_loss")][0] == \
        (0, pytest.approx(summary["eval_loss_before"]))
    for key in ("loss", "grad_norm", "tokens"):
        assert _logged(logged["history"], key) == {r["step"]: r[key] for r in records}
    assert _logged(logged["history"], "eval_loss") == {0: summary["eval_loss_before"], **{
        r["step"]: r["eval_loss"] for r in records if r["eval_loss"] is not None}}
    assert _logged(logged["history"], "skipped") == {r["step"]: int(r["skipped"]) for r in records}
    assert logged["config"]["train"]["wandb_project"] == "logra-tests"
    assert logged["config"]["model"]["num_layers"] == 1
    assert logged["summary"]["eval_loss_after"] == pytest.approx(summary["eval_loss_after"])
    assert logged["summary"]["steps"] == 4


def test_resume_continues_the_wandb_run_and_a_new_run_starts_another(tmp_path, capsys, one_thread, offline):
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=4", *LM_SMALL,
                 "--wandb-project", "logra-tests"]) == 0
    first_id = (run / "wandb_run_id").read_text().strip()
    assert main(["train", "--resume", str(run), "train.steps=6"]) == 0
    assert (run / "wandb_run_id").read_text().strip() == first_id
    first, second = offline_runs(run)
    assert read_offline_run(second)["id"] == first_id
    assert [h["step"] for h in read_offline_run(second)["history"]] == [5, 6]
    assert read_offline_run(second)["name"] == run.name  # the run directory's name without --wandb-exp-name

    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", *LM_SMALL, "train.overwrite=true",
                 "--wandb-project", "logra-tests"]) == 0
    capsys.readouterr()
    new_id = (run / "wandb_run_id").read_text().strip()
    assert new_id != first_id
    runs = offline_runs(run)
    assert len(runs) == 3 and (first in runs and second in runs)  # an unsynced offline run is never deleted
    # by id, not by position: directories named in the same second sort by their random ids
    (newest,) = [r for r in runs if r not in (first, second)]
    assert read_offline_run(newest)["id"] == new_id


RL_SMALL = ["train.progress=false", "rl.prompts_per_step=2", "rl.group_size=4", "rl.eval_interval=0", "task.num_eval=0",
            "train.save_interval=0"]

FAILING_REWARD = '''
CALLS = [0]


def fails_at_step_2(problem, completion):
    """Scores the 8 completions of RL step 1 (2 prompts x 4), then fails: the reward server is gone."""
    CALLS[0] += 1
    if CALLS[0] > 8:
        raise KeyError("reward server gone")
    return 0.0
'''


def test_a_job_that_raises_finishes_its_wandb_run_as_failed(tmp_path, monkeypatch, capsys, one_thread, offline):
    # a W&B run left open in the process would be returned by the next wandb.init: another job's records in it
    from megatron_logra.rl.step_guard import RewardError

    (tmp_path / "failing_reward_plugin.py").write_text(FAILING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    failed = tmp_path / "failed"
    with pytest.raises(RewardError, match="RL step 2"):
        main(["train", "tiny", f"train.run_dir={failed}", "rl.steps=3", *RL_SMALL,
              "task.reward=failing_reward_plugin:fails_at_step_2", "--wandb-project", "logra-tests"])
    (files,) = offline_runs(failed)
    logged = read_offline_run(files)
    assert [h["step"] for h in logged["history"]] == [1] and logged["exit_code"] == 1  # finished, as failed
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", *LM_SMALL,
                 "--wandb-project", "logra-tests"]) == 0
    capsys.readouterr()
    (files,) = offline_runs(run)
    logged = read_offline_run(files)
    assert logged["id"] == (run / "wandb_run_id").read_text().strip() and logged["exit_code"] == 0
    assert [h["step"] for h in logged["history"]] == [0, 1, 2]  # step 0: held-out loss before training
    assert [h["step"] for h in read_offline_run(offline_runs(failed)[0])["history"]] == [1]


def test_wandb_save_dir_holds_the_files(tmp_path, capsys, one_thread, offline):
    run, files = tmp_path / "run", tmp_path / "wandb-files"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", *LM_SMALL,
                 "train.wandb_project=p", f"train.wandb_save_dir={files}"]) == 0
    capsys.readouterr()
    assert not offline_runs(run) and len(offline_runs(files)) == 1


def test_a_missing_wandb_package_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where it is not installed
    run = tmp_path / "run"
    err = exit_2(["train", "lm-tiny", f"train.run_dir={run}", "--wandb-project", "p"], capsys)
    assert "train.wandb_project='p' needs the wandb package" in err and "pip install wandb" in err
    assert not run.exists()
    err = exit_2(["config", "lm-tiny", "--wandb-project", "p"], capsys)
    assert "pip install wandb" in err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"wandb_exp_name": "x"}, "train.wandb_exp_name set without train.wandb_project"),
    ({"wandb_save_dir": "d", "wandb_entity": "team"}, "train.wandb_entity, train.wandb_save_dir set without"),
    ({"wandb_project": "team/proj"}, "give the team in train.wandb_entity"),
])
def test_inconsistent_wandb_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_logged_samples_are_wandb_tables_holding_samples_jsonl(tmp_path, capsys, one_thread, offline):
    run = tmp_path / "run"
    assert main(["train", "tiny", f"train.run_dir={run}", "rl.steps=1", "train.progress=false", "rl.prompts_per_step=2",
                 "rl.group_size=2", "task.num_eval=3", "train.save_interval=0", "rl.log_samples=3",
                 "--wandb-project", "logra-tests"]) == 0
    capsys.readouterr()
    (files,) = offline_runs(run)
    logged = read_offline_run(files)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    # a table in a history record: its reference's fields under nested keys (samples/eval/_type, .../path)
    tables = [(h["step"], key, h[f"{key}/path"]) for h in logged["history"]
              for key in ("samples/train", "samples/eval") if h.get(f"{key}/_type") == "table-file"]
    # before training (eval), the step's rollouts (train), after the last step (eval)
    assert [(step, key) for step, key, _ in tables] == [(0, "samples/eval"), (1, "samples/train"), (1, "samples/eval")]
    for step, key, path in tables:
        table = json.loads((files / "files" / path).read_text())
        rows = [dict(zip(table["columns"], row)) for row in table["data"]]
        want = [r for r in samples if r["step"] == step and r["split"] == key.split("/")[1]]
        assert rows == want and len(want) == 3
