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


def test_help_lists_every_megatron_flag_the_parser_knows(capsys):
    """Each Megatron-LM flag the override parser maps, ignores, restricts or refuses is named in ``train --help``,
    so a user pasting a launch line can see what each flag does here before running it."""
    from megatron_logra import megatron_flags as mf

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    tables = (mf.MEGATRON_ALIASES, mf.JOB_ALIASES, mf.OPTIMIZER_ALIASES, mf.SCHEDULE_RATIO_FLAGS, mf.CHECK_FLAGS,
              mf.MEGATRON_FLAGS, mf.LOAD_FLAGS, mf.IGNORED_SWITCHES, mf.IGNORED_VALUE_FLAGS, mf.NEUTRAL_FLAGS,
              mf.REFUSED_SWITCHES, mf.REFUSED_VALUE_FLAGS)
    named = {word.rstrip(",:").removeprefix("--") for word in out.split() if word.startswith("--")}
    missing = sorted({flag for table in tables for flag in table} - named)
    assert not missing, f"train --help does not name: {missing}"
    assert "--load DIR: train.run_dir=DIR train.resume=true" in out
