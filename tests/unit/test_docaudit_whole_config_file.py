"""A whole config written by ``megatron-logra config RECIPE > FILE`` (or a run's ``config.yaml``) read back as a
recipe file states every field, ``train.progress`` with ``train.log_interval``: that is no interval the user chose,
so it gets no "has no effect" warning (it did, for every ``megatron-logra train RUN/config.yaml ...``); a file or
command line that does choose one still does."""

from __future__ import annotations

import logging

import pytest
import yaml

from megatron_logra.cli import main
from megatron_logra.config import parse_args_to_config


def _log_interval_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "megatron_logra.config.checks" and "train.log_interval" in r.getMessage()]


@pytest.fixture
def whole_config(tmp_path, capsys):
    assert main(["config", "tiny"]) == 0
    path = tmp_path / "tiny.yaml"
    path.write_text(capsys.readouterr().out)
    assert yaml.safe_load(path.read_text())["train"]["progress"] is True
    return path


def test_whole_config_file_does_not_warn_about_its_log_interval(whole_config, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.checks"):
        cfg = parse_args_to_config(str(whole_config), ["train.overwrite=true"])
    assert cfg.job == "rl" and cfg.train.progress
    assert not _log_interval_warnings(caplog)


def test_a_file_that_chooses_an_interval_still_warns(tmp_path, caplog):
    path = tmp_path / "every_step.yaml"
    path.write_text("recipe: tiny\ntrain:\n  log_interval: 1\n")
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.checks"):
        assert parse_args_to_config(str(path), []).train.log_interval == 1
    (message,) = _log_interval_warnings(caplog)
    assert str(path) in message and "train.progress=false" in message


def test_the_command_line_at_the_default_still_warns(whole_config, caplog):
    default = yaml.safe_load(whole_config.read_text())["train"]["log_interval"]
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.checks"):
        parse_args_to_config(str(whole_config), ["--log-interval", str(default)])
    (message,) = _log_interval_warnings(caplog)
    assert "--log-interval" in message
