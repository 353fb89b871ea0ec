"""The command line's ways of continuing (or evaluating) a run:

* ``train.resume=true`` / a bare ``--resume`` with a recipe continues the run in ``train.run_dir`` only with the
  config that run saved (launch settings aside: length, TP/PP/DP, logging, checkpointing); any other field is an
  error naming it with both values; without a checkpoint it starts from step 0 with a warning (Megatron-LM's
  ``--load``);
* ``--resume RUN_DIR`` takes a directory whose name holds ``=``, refuses ``train.overwrite=true``, accepts
  ``train.run_dir`` spelling the same directory otherwise, and names RUN_DIR/config.yaml and the overrides
  that fit when the saved TP × PP does not fit this launch (``eval RUN_DIR`` lowers a saved layout to one
  that fits, and its errors name ``eval``);
* ``megatron-logra`` without a command and ``recipes`` with arguments are usage errors (exit status 2).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_logra.cli import main
from support.cli import exit_2 as _exit_2
from support.cli import one_process_cli  # noqa: F401  (autouse fixture)
from support.run_fixtures import fake_run_dir

SMALL = ["train.progress=false", "train.eval_interval=0", "train.save_interval=0", "--num-layers", "1",
         "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]
"""A quick lm-tiny (about a second a step on 2 CPU cores)."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread) -> Path:
    """A real lm-tiny run of 2 steps (its checkpoint at step 2); tests copy it before changing anything."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", *SMALL]) == 0
    return run


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


# --- train.resume=true / bare --resume with a recipe ------------------------------------------------------------

@pytest.mark.parametrize("resume", ["train.resume=true", "--resume"])
def test_a_recipe_resume_with_another_config_is_refused_naming_each_field(trained, tmp_path, capsys, resume):
    run = _copy(trained, tmp_path / "run")
    before = _files(run)
    err = _exit_2(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=3", *SMALL, "data.task=copy",
                   "train.global_batch_size=64", resume], capsys)
    assert "data.task: 'reverse' saved, 'copy' given" in err
    assert "train.global_batch_size: 32 saved, 64 given" in err
    assert f"megatron-logra train --resume {run} [OVERRIDE ...]" in err and "another train.run_dir" in err
    assert "train.steps:" not in err  # a launch setting: may differ
    assert _files(run) == before  # config.yaml, metrics and checkpoints untouched


def test_a_recipe_resume_with_the_runs_config_continues_with_other_launch_settings(trained, tmp_path, capsys,
                                                                                     caplog):
    run = _copy(trained, tmp_path / "run")
    with caplog.at_level("INFO", logger="megatron_logra.train.lm"):
        assert main(["train", "lm-tiny", f"train.run_dir={run}", *SMALL, "train.resume=true", "train.steps=3",
                     "--tensor-model-parallel-size", "1", "train.log_interval=1", "train.keep_last=1",
                     "train.micro_batch_size=8"]) == 0
    assert any("resuming from" in r.getMessage() and "at step 2" in r.getMessage() for r in caplog.records)
    assert json.loads(capsys.readouterr().out)["stopped"] is None  # the summary: the run ended normally
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    saved = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (saved["steps"], saved["micro_batch_size"], saved["keep_last"]) == (3, 8, 1)


def test_resume_differences_skip_launch_settings_and_fields_only_one_side_has():
    from megatron_logra.cli import resume_differences
    from megatron_logra.config import to_dict, parse_args_to_config

    saved = to_dict(parse_args_to_config("lm-tiny", ["train.steps=5"]))
    saved["parallel"]["tp"] = 4  # a run saved at TP4
    saved["train"]["removed_field"] = 1  # a field of another version
    cfg = parse_args_to_config("lm-tiny", ["train.steps=9", "train.resume=true", "train.run_dir=elsewhere",
                                           "train.exit_duration_minutes=5", "optimizer.logra.rank=8"])
    assert resume_differences(saved, cfg) == [("optimizer.logra.rank", saved["optimizer"]["logra"]["rank"], 8)]


def test_a_recipe_resume_without_a_checkpoint_starts_at_step_0_with_a_warning(tmp_path, capsys, caplog, one_thread):
    run = tmp_path / "empty"
    with caplog.at_level("WARNING", logger="megatron_logra.cli.resume"):
        assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=1", *SMALL, "train.resume=true"]) == 0
    warned = [r.getMessage() for r in caplog.records
              if r.name == "megatron_logra.cli.resume" and r.levelname == "WARNING"]
    assert any(f"no checkpoint in {run}" in m and "step 0" in m for m in warned), warned
    assert json.loads(capsys.readouterr().out)["stopped"] is None  # the summary: the run ended normally
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_a_recipe_resume_with_overwrite_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run_dir(run)
    before = _files(run)
    err = _exit_2(["train", "lm-tiny", f"train.run_dir={run}", "train.resume=true", "train.overwrite=true"], capsys)
    assert "train.overwrite=true" in err and "delete" in err
    assert _files(run) == before


# --- --resume RUN_DIR and eval RUN_DIR -------------------------------------------------------------------------

def test_resume_takes_a_run_dir_whose_name_holds_an_equals_sign(tmp_path, capsys, monkeypatch):
    run = tmp_path / "lr=0.1" / "run"
    fake_run_dir(run)
    capsys.readouterr()
    assert main(["config", "--resume", str(run), "train.steps=5"]) == 0
    train = yaml.safe_load(capsys.readouterr().out)["train"]
    assert (train["run_dir"], train["resume"], train["steps"]) == (str(run), True, 5)
    monkeypatch.chdir(run.parent)  # a relative name that reads like an override, but is an existing directory
    other = Path("lr=0.2")
    fake_run_dir(run.parent / other)
    assert main(["config", "--resume", str(other)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["run_dir"] == str(other)
    # an override after a bare --resume stays one
    assert main(["config", "lm-tiny", "--resume", "train.steps=7"]) == 0
    train = yaml.safe_load(capsys.readouterr().out)["train"]
    assert (train["resume"], train["steps"]) == (True, 7)


def test_resume_with_overwrite_is_refused_and_a_saved_overwrite_is_dropped(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run_dir(run)
    before = _files(run)
    for command in ("train", "config"):
        err = _exit_2([command, "--resume", str(run), "train.overwrite=true"], capsys)
        assert f"train.overwrite=true with --resume {run}" in err and "delete" in err
    assert _files(run) == before
    # a run first launched with train.overwrite=true saved it: resuming never applies it
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["train"]["overwrite"] = True
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert main(["config", "--resume", str(run)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["overwrite"] is False


def test_resume_with_train_run_dir_spelling_the_same_directory_is_accepted(tmp_path, capsys, monkeypatch):
    run = tmp_path / "lm1"
    fake_run_dir(run)
    monkeypatch.chdir(tmp_path)
    for spelling in (str(run), f"{run}/", "./lm1"):
        assert main(["config", "--resume", "lm1", f"train.run_dir={spelling}"]) == 0, spelling
        assert yaml.safe_load(capsys.readouterr().out)["train"]["run_dir"] == "lm1"
    err = _exit_2(["config", "--resume", "lm1", f"train.run_dir={tmp_path / 'lm2'}"], capsys)
    assert "--resume lm1 continues the run in lm1" in err and "lm2" in err


def _tp2_pp2_run(run: Path) -> None:
    """A fake run saved at TP2 × PP2 (config.yaml and the checkpoint's copy)."""
    fake_run_dir(run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["parallel"].update(tp=2, pp=2)
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    meta_path = run / "checkpoints" / "step_00000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"] = saved
    meta_path.write_text(json.dumps(meta))


def test_a_saved_layout_larger_than_the_launch_names_config_yaml_and_the_overrides(tmp_path, capsys):
    run = tmp_path / "run"
    _tp2_pp2_run(run)
    argv = ["train", "--resume", "{run}"]
    err = _exit_2([a.format(run=run) for a in argv], capsys)
    cfg_path = run / "config.yaml"
    assert f"parallel.tp=2 (from {cfg_path}) and parallel.pp=2 (from {cfg_path})" in err
    assert "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1" in err
    assert "parallel.tp=1 parallel.pp=1" in err and "torchrun --nproc-per-node 4" in err
    # config only prints it, and the override that fits this launch is taken
    assert main(["config", "--resume", str(run)]) == 0
    capsys.readouterr()
    err = _exit_2([*[a.format(run=run) for a in argv], "parallel.tp=1"], capsys)
    assert f"parallel.pp=2 (from {cfg_path})" in err and "parallel.tp=" not in err



def test_eval_lowers_a_saved_layout_to_one_that_fits_but_not_a_given_one(tmp_path, caplog):
    """``eval RUN`` in one process evaluates a run saved at TP2 × PP2 at TP1 × PP1 (it writes nothing and reads the
    checkpoint at any layout); a layout given on its command line that does not fit is still refused."""
    from megatron_logra.cli.run_dir import run_dir_config

    run = tmp_path / "run"
    _tp2_pp2_run(run)
    with caplog.at_level(logging.INFO, logger="megatron_logra.cli.run_dir"):
        cfg = run_dir_config(run, [], command="eval")
    assert (cfg.parallel.tp, cfg.parallel.pp) == (1, 1)
    assert any("evaluating at tp=1 × pp=1" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"parallel.tp=4 \(given\)"):
        run_dir_config(run, ["parallel.tp=4", "parallel.pp=1"], command="eval")
    # resuming training never changes the layout by itself
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        run_dir_config(run, [], command="train")


def test_eval_errors_name_eval_not_resume(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run_dir(run)
    err = _exit_2(["eval", str(run), "lm-tiny"], capsys)
    assert f"eval {run} takes its recipe from {run / 'config.yaml'}; drop 'lm-tiny'" in err and "--resume" not in err
    err = _exit_2(["eval", str(run), f"train.run_dir={tmp_path / 'other'}"], capsys)
    assert f"eval {run} evaluates the run in {run}" in err and "--resume" not in err
    empty = tmp_path / "crashed"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text((run / "config.yaml").read_text())
    err = _exit_2(["eval", str(empty)], capsys)
    assert "has no checkpoint" in err and "to evaluate" in err and "continue" not in err


# --- usage errors ---------------------------------------------------------------------------------------------

def test_no_command_prints_the_usage_and_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: megatron-logra") and "error: a command is required (train, eval" in err
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, "-m", "megatron_logra.cli"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "a command is required" in proc.stderr and "Traceback" not in proc.stderr


def test_recipes_refuses_arguments(capsys):
    err = _exit_2(["recipes", "extra"], capsys)
    assert "recipes takes no arguments (got 'extra')" in err and "config RECIPE" in err
    assert main(["recipes"]) == 0
    assert "lm-tiny" in capsys.readouterr().out
