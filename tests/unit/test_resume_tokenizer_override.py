"""``--resume RUN_DIR`` and ``eval RUN_DIR`` of an RL run read the run's own ``RUN/tokenizer``: an override of
``tokenizer.*`` is refused, naming the field and both values (it was ignored, while ``config.yaml`` recorded
it as the run's tokenizer). Without ``RUN/tokenizer`` (lost) the run takes ``tokenizer.*`` with a warning, so
the override stays allowed there; so does one that repeats the saved value."""

from __future__ import annotations

import shutil

import yaml

from megatron_logra.cli import main
from support.cli import exit_2, one_process_cli  # noqa: F401 - autouse fixture
from support.run_fixtures import fake_run_dir


def _rl_run(tmp_path, *, with_tokenizer: bool = True):
    run = tmp_path / "run"
    cfg = fake_run_dir(run, "tiny")
    if with_tokenizer:
        shutil.copytree(cfg.tokenizer.path, run / "tokenizer")
    return run, cfg


def test_a_tokenizer_override_on_resume_is_refused(tmp_path, capsys):
    run, cfg = _rl_run(tmp_path)
    other = shutil.copytree(cfg.tokenizer.path, tmp_path / "other_tokenizer")  # a readable tokenizer elsewhere
    before = (run / "config.yaml").read_bytes()
    err = exit_2(["config", "--resume", str(run), f"tokenizer.path={other}"], capsys)
    assert f"--resume {run} reads the run's own tokenizer {run / 'tokenizer'}" in err
    assert f"tokenizer.path={str(other)!r} (saved: {cfg.tokenizer.path!r})" in err
    err = exit_2(["eval", str(run), "tokenizer.kind=char"], capsys)
    assert "tokenizer.kind='char' (saved: 'words')" in err
    assert (run / "config.yaml").read_bytes() == before


def test_the_saved_value_or_a_run_without_its_tokenizer_takes_the_override(tmp_path, capsys):
    run, cfg = _rl_run(tmp_path)
    assert main(["config", "--resume", str(run), f"tokenizer.path={cfg.tokenizer.path}", "rl.steps=9"]) == 0
    shutil.rmtree(run / "tokenizer")
    restored = shutil.copytree(cfg.tokenizer.path, tmp_path / "restored_tokenizer")
    capsys.readouterr()
    assert main(["config", "--resume", str(run), f"tokenizer.path={restored}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["tokenizer"]["path"] == str(restored)
