"""``-h`` / ``--help`` after ``train``, ``eval`` and ``config`` print the subcommand's usage and exit 0
(they were read as an option without a value, or as a run directory)."""

from __future__ import annotations

import pytest

from megatron_logra.cli import main


@pytest.mark.parametrize("argv", [
    ["train", "--help"], ["train", "-h"], ["train", "tiny", "rl.steps=3", "--help"], ["train", "--resume", "RUN", "-h"],
    ["eval", "--help"], ["eval", "RUN", "-h"],
    ["config", "--help"], ["config", "tiny", "-h"],
])
def test_help_prints_the_usage_and_exits_0(argv, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: megatron-logra {argv[0]} ") and not err
    assert "key=value" in out and "--key value" in out  # override syntax
    assert "--train-iters" in out and "--tensor-model-parallel-size" in out and "--bf16" in out  # flags
    assert "megatron-logra config RECIPE" in out  # how to list the fields


@pytest.mark.parametrize("command", ["train", "config"])
def test_help_says_resume_takes_an_optional_run_dir(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--resume [RUN_DIR]" in out and "train.resume=true" in out  # both forms, next to each other
