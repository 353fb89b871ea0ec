"""A new user's mistakes with the command line, found walking through the README and docs/usage.md:

* Ctrl-C (SIGINT) during ``train`` ends with one line naming the latest checkpoint and the ``--resume`` command,
  exit status 130, no traceback; the resume then continues;
* a corrupt ``meta.json`` of a run's latest checkpoint (``--resume`` / ``eval`` / ``config --resume``) names the
  newest earlier checkpoint and how to continue from it, as the other checkpoint damage does;
* a mistyped key in a run's ``config.yaml`` (``train.stepz``) is refused naming it, instead of the file being taken
  for one cut short and silently replaced by the checkpoint's copy of the config (dropping every edit);
* a YAML recipe without ``recipe:`` (not a whole config) warns that it starts from the built-in defaults.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_logra.cli import main
from support import forked
from support.cli import exit_2 as _exit_2
from support.cli import one_process_cli  # noqa: F401  (autouse fixture)

SMALL = ["train.progress=false", "train.eval_interval=0", "--num-layers", "1", "--hidden-size", "32",
         "--ffn-hidden-size", "64", "logra.rank=4"]
"""A quick lm-tiny (well under a second a step on 2 CPU cores)."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread) -> Path:
    """A real lm-tiny run of 4 steps with checkpoints at steps 2 and 4; tests copy it before changing it."""
    run = tmp_path_factory.mktemp("walk") / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=4", "train.save_interval=2", *SMALL]) == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    return run


_CLI_WITH_CTRL_C = """
import runpy, signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh python installs for a SIGINT not ignored
runpy.run_module("megatron_logra.cli", run_name="__main__", alter_sys=True)
"""


def _cli(*args: str) -> subprocess.Popen | forked.Python:
    """``python -m megatron_logra.cli ARGS...`` in a process of its own (forked warm where it can be), which Ctrl-C
    (SIGINT) interrupts: a child of a shell's background job inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt; so may the fork server."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MEGATRON_LOGRA_TRACEBACK")}
    env["OMP_NUM_THREADS"] = "1"
    if forked.usable():
        return forked.Python(["-c", _CLI_WITH_CTRL_C, *args], env=env)
    return subprocess.Popen([sys.executable, "-m", "megatron_logra.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_mid_run_says_how_to_resume_without_a_traceback(tmp_path):
    run = tmp_path / "run"
    proc = _cli("train", "lm-tiny", f"train.run_dir={run}", "train.steps=100000", "train.save_interval=1",
                "train.keep_last=2", *SMALL)
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert latest.exists(), proc.communicate(timeout=60)[1][-3000:]
    time.sleep(1.0)  # a few more steps: the signal lands anywhere in a step or a save
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("megatron-logra: interrupted")]
    assert len(line) == 1 and f"megatron-logra train --resume {run}" in line[0], err[-3000:]
    step = int(latest.read_text().strip().split("_")[1])
    assert f"step_{step:08d}" in line[0]
    # and the resume the line names continues the run
    resumed = _cli("train", "--resume", str(run), f"train.steps={step + 1}")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert (summary["resumed_from_step"], summary["steps"]) == (step, step + 1)


def test_ctrl_c_before_any_checkpoint_says_nothing_is_lost():
    from megatron_logra.cli.train import _how_to_continue
    from megatron_logra.config import parse_args_to_config

    cfg = parse_args_to_config("lm-tiny", ["train.run_dir=/nonexistent/walkthrough-run"])
    assert _how_to_continue(cfg) == "no checkpoint was saved, and nothing to continue: run the command again"


@pytest.mark.parametrize("command", [["train", "--resume"], ["eval"], ["config", "--resume"]])
def test_a_corrupt_meta_json_names_the_earlier_checkpoint(trained, tmp_path, capsys, command):
    run = shutil.copytree(trained, tmp_path / "run")
    (run / "checkpoints" / "step_00000004" / "meta.json").write_text("{\n")
    err = _exit_2([*command, str(run)], capsys)
    assert "step_00000004/meta.json is corrupt" in err
    assert f"echo step_00000002 > {run / 'checkpoints' / 'latest'}" in err, err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"  # nothing changed


@pytest.mark.parametrize("command", [["train", "--resume"], ["eval"], ["config", "--resume"]])
def test_a_mistyped_key_in_config_yaml_is_refused_not_replaced(trained, tmp_path, capsys, command):
    run = shutil.copytree(trained, tmp_path / "run")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["train"]["stepz"] = saved["train"].pop("steps")  # the user meant to edit the steps
    saved["optimizer"]["logra"]["lr"] = 5e-4  # and another edit the fallback would drop
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    before = (run / "config.yaml").read_bytes()
    err = _exit_2([*command, str(run)], capsys)
    assert "config.yaml holds a key that no config field has: 'train.stepz' (did you mean train.steps?)" in err
    assert (run / "config.yaml").read_bytes() == before


def test_an_unedited_config_yaml_with_mapping_fields_still_resumes(tmp_path, capsys):
    """``task.dataset_kwargs`` is a mapping field, not a section: its keys are the datasets, never checked."""
    from support.run_fixtures import fake_run_dir

    from megatron_logra.config import to_dict, load_recipe

    run = tmp_path / "run"
    fake_run_dir(run)
    saved = to_dict(load_recipe("tiny"))
    saved["train"]["run_dir"] = str(run)
    assert saved["task"]["dataset_kwargs"]  # chain_sum's
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    meta = run / "checkpoints" / "step_00000002" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "config": saved}))
    capsys.readouterr()
    assert main(["config", "--resume", str(run)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["task"]["dataset_kwargs"] == saved["task"]["dataset_kwargs"]


def test_a_recipe_file_without_a_base_warns_unless_it_is_a_whole_config(tmp_path, caplog):
    from megatron_logra.config import RECIPES, load_recipe, to_dict

    partial = tmp_path / "partial.yaml"
    partial.write_text("optimizer:\n  logra:\n    rank: 16\n")
    whole = tmp_path / "whole.yaml"
    whole.write_text(yaml.safe_dump(to_dict(RECIPES["lm-tiny"]()), sort_keys=False))
    based = tmp_path / "based.yaml"
    based.write_text("recipe: lm-tiny\noptimizer:\n  logra:\n    rank: 16\n")
    with caplog.at_level("WARNING", logger="megatron_logra.config.recipe_files"):
        load_recipe(str(partial))
    warned = [r.getMessage() for r in caplog.records if r.name == "megatron_logra.config.recipe_files"]
    assert len(warned) == 1 and "names no base recipe" in warned[0] and "'recipe: lm-tiny'" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_logra.config.recipe_files"):
        assert load_recipe(str(whole)).optimizer.logra.rank == RECIPES["lm-tiny"]().optimizer.logra.rank
        assert load_recipe(str(based)).optimizer.logra.rank == 16
    assert not [r for r in caplog.records if r.name == "megatron_logra.config.recipe_files"]


@pytest.mark.parametrize("out", ["afile/x", "afile/x.png"])
def test_plot_to_an_unwritable_out_names_it(trained, tmp_path, capsys, out):
    (tmp_path / "afile").write_text("not a folder")
    err = _exit_2(["plot", str(trained), "--out", str(tmp_path / out)], capsys)
    assert f"cannot write the figure to {tmp_path / out}: {tmp_path / 'afile'} is a file, not a folder" in err
    assert "choose another --out" in err
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_plot_of_a_run_without_metrics_still_names_the_run(tmp_path, capsys):
    err = _exit_2(["plot", str(tmp_path)], capsys)
    assert f"{tmp_path / 'metrics.jsonl'} does not exist: is {tmp_path} a run directory?" in err


@pytest.mark.parametrize("override,field", [(["logra.rank=8"], "optimizer.logra.rank"),
                                            (["--lr", "1e-3"], "optimizer.logra.lr")])
def test_eval_refuses_optimizer_overrides_naming_them(trained, capsys, override, field):
    """``eval`` loads the saved optimizer state with the weights; an optimizer override would otherwise be met as
    a checkpoint mismatch whose advice is to resume or start a new run."""
    err = _exit_2(["eval", str(trained), *override], capsys)
    assert f"optimizer settings do not apply to it, but the overrides change {field}: drop them" in err, err
    assert "resume" not in err


def test_eval_with_only_non_optimizer_overrides_evaluates(trained, capsys):
    capsys.readouterr()
    assert main(["eval", str(trained), "parallel.tp=1", "train.progress=false"]) == 0
    out = capsys.readouterr().out
    assert out.strip(), "eval printed no result"


@pytest.mark.parametrize("damage", ["meta", "shard"])
def test_export_of_a_damaged_checkpoint_names_the_earlier_one(trained, tmp_path, capsys, damage):
    """``convert mcore-to-hf --mcore RUN`` of a run whose latest checkpoint is damaged names the earlier checkpoint
    and the ``--mcore`` that exports it; that export then works."""
    run = shutil.copytree(trained, tmp_path / "run")
    step4 = run / "checkpoints" / "step_00000004"
    if damage == "meta":
        (step4 / "meta.json").write_text("{\n")
    else:
        shard = sorted((step4 / "dist").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    assert main(["convert", "mcore-to-hf", "--mcore", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    earlier = run / "checkpoints" / "step_00000002"
    assert f"the run's newest earlier checkpoint is step_00000002: export it with --mcore {earlier}" in err, err
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    assert main(["convert", "mcore-to-hf", "--mcore", str(earlier), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
