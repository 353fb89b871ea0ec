"""``resume_config``: the config a resumed run continues with, ``config.yaml`` checked against the copy the
latest checkpoint's meta.json holds.

A run directory with a real (tiny, weights-only) checkpoint saved with the run's config, whose KL settings
differ from the defaults, and a ``config.yaml`` holding the same config. A ``config.yaml`` cut short at a line
boundary still parses but loses every later section (they would become defaults); it, an empty one, a missing
one and an unparseable one must give the checkpoint's config; one with other values wins, with a warning.
"""

from __future__ import annotations

import logging

import pytest
import yaml

from megatron_logra.checkpoint import save_checkpoint
from megatron_logra.checkpoint.integrity import atomic_write_text
from megatron_logra.checkpoint.run_dir import resume_config
from megatron_logra.config import RunConfig, from_dict, to_dict
from megatron_logra.kl.controller import KLConfig
from megatron_logra.models.gpt import ModelConfig
from test_checkpoint_checksums import _model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


RUN_CONFIG = to_dict(RunConfig(model=ModelConfig(vocab_size=128, seq_length=128),
                               kl=KLConfig(mode="calibrated", budget_start=0.002, horizon=60)))
"""One ``train`` would start (``config --resume`` runs its checks): the task's character tokenizer (104 tokens) and
prompts (~100 tokens) fit the model."""


@pytest.fixture(scope="module")
def saved_run(groups, tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "run"
    save_checkpoint(run, 1, _model(groups, seed=3), None, groups, config=RUN_CONFIG)
    return run


@pytest.fixture
def run(saved_run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    atomic_write_text(copy / "config.yaml", yaml.safe_dump(RUN_CONFIG, sort_keys=False))
    return copy


def _kl(config: dict) -> tuple:
    kl = from_dict(RunConfig, config).kl
    return kl.mode, kl.budget_start, kl.horizon


def test_an_intact_config_yaml_is_the_config(run, caplog):
    with caplog.at_level(logging.WARNING):
        assert resume_config(run) == RUN_CONFIG
    assert not caplog.records


@pytest.mark.parametrize("damage", ["cut_before_kl", "cut_mid_line", "empty", "missing", "unparseable"])
def test_a_damaged_config_yaml_gives_the_checkpoints_config(run, caplog, damage):
    path = run / "config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    if damage == "cut_before_kl":
        path.write_text("".join(lines[: lines.index("kl:\n")]))
        assert _kl(yaml.safe_load(path.read_text()) | {"kl": {}}) != _kl(RUN_CONFIG)  # what the cut file says
    elif damage == "cut_mid_line":
        text = path.read_text()
        path.write_text(text[: text.index("budget_start: 0.002") + len("budget_start: 0.0")])
    elif damage == "empty":
        path.write_text("")
    elif damage == "missing":
        path.unlink()
    else:
        path.write_text("kl: {mode: [\n")
    with caplog.at_level(logging.WARNING, logger="megatron_logra.checkpoint.resuming"):
        config = resume_config(run)
    assert config == RUN_CONFIG and _kl(config) == ("calibrated", 0.002, 60)
    assert "config.yaml is not usable" in caplog.text and "step_00000001" in caplog.text


def test_config_yaml_with_other_values_wins_with_a_warning(run, caplog):
    changed = to_dict(RunConfig(kl=KLConfig(mode="calibrated", budget_start=0.002, horizon=90)))
    atomic_write_text(run / "config.yaml", yaml.safe_dump(changed, sort_keys=False))
    with caplog.at_level(logging.WARNING, logger="megatron_logra.checkpoint.resuming"):
        assert resume_config(run) == changed
    assert "kl.horizon: 90 there, 60 in the checkpoint" in caplog.text


def test_no_checkpoint_and_no_usable_config_yaml_is_an_error(tmp_path):
    (tmp_path / "config.yaml").write_text("")
    with pytest.raises(ValueError, match=r"config\.yaml: it is empty, and .* has no checkpoint holding the run's "
                                         r"config"):
        resume_config(tmp_path)
    atomic_write_text(tmp_path / "config.yaml", yaml.safe_dump(RUN_CONFIG))
    assert resume_config(tmp_path) == RUN_CONFIG


def test_the_command_line_resumes_with_the_checkpoints_config_when_config_yaml_is_cut_short(run, capsys):
    """``megatron-logra config --resume RUN``: what ``train --resume RUN`` would run with."""
    from megatron_logra.cli import main

    path = run / "config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: lines.index("kl:\n")]))
    assert main(["config", "--resume", str(run)]) == 0
    kl = yaml.safe_load(capsys.readouterr().out)["kl"]
    assert (kl["mode"], kl["budget_start"], kl["horizon"]) == ("calibrated", 0.002, 60)
