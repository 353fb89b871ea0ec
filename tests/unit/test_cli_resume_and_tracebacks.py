"""``--resume=RUN_DIR`` is ``--resume RUN_DIR`` (the help says ``--key=value`` is ``--key value``; it was read as
an unknown field ``resume``), and ``MEGATRON_LOGRA_TRACEBACK=1`` shows the traceback of config errors too (only
errors raised inside a run honoured it)."""

from __future__ import annotations

import pytest
import yaml

from megatron_logra.cli import main
from support.run_fixtures import fake_run_dir


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_resume_equals_run_dir_is_resume_run_dir(tmp_path, capsys, form):
    run = tmp_path / "run"
    fake_run_dir(run)
    args = ["--resume", str(run)] if form == "separate" else [f"--resume={run}"]
    assert main(["config", *args, "train.steps=9"]) == 0
    train = yaml.safe_load(capsys.readouterr().out)["train"]
    assert (train["run_dir"], train["resume"], train["steps"]) == (str(run), True, 9)


@pytest.mark.parametrize("word, resume", [("true", True), ("1", True), ("False", False), ("no", False)])
def test_resume_equals_a_boolean_stays_the_train_resume_flag(capsys, word, resume):
    assert main(["config", "lm-tiny", f"--resume={word}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["resume"] is resume


def test_resume_equals_a_directory_without_a_run_names_its_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", f"--resume={tmp_path}"])
    assert info.value.code == 2 and "config.yaml does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["config", "tiny", "logra.rank=0"],
    ["train", "tiny", "logra.rank=0"],
    ["config", "--resume", "/nonexistent/run"],
    ["eval", "/nonexistent/run"],
])
def test_config_errors_show_a_traceback_with_megatron_logra_traceback(monkeypatch, capsys, argv):
    monkeypatch.delenv("MEGATRON_LOGRA_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "megatron-logra: error: " in capsys.readouterr().err
    monkeypatch.setenv("MEGATRON_LOGRA_TRACEBACK", "1")
    with pytest.raises(ValueError):
        main(argv)
    monkeypatch.setenv("MEGATRON_LOGRA_TRACEBACK", "0")
    with pytest.raises(SystemExit):
        main(argv)


def test_a_duplicate_key_in_a_runs_config_yaml_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run_dir(run)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text + "job: lm\n")
    with pytest.raises(SystemExit) as info:
        main(["config", "--resume", str(run)])
    assert info.value.code == 2 and "key 'job' appears twice" in capsys.readouterr().err
