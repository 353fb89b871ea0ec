"""Megatron-LM flags in a YAML recipe whose meaning depends on the rest of the config (``lr-warmup-fraction``,
``lr``, ``train-iters``) follow what the command line (or a file naming the recipe as its base) changes, as
the same flags given on the command line do: Megatron-LM's warmup is the fraction of the final decay length,
and ``--lr`` sets the lr of the optimizer that runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.config import parse_args_to_config


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_warmup_fraction_of_the_steps_the_command_line_sets(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "recipe: lm-tiny\nlr-warmup-fraction: 0.1\n")
    # the file alone: 10% of lm-tiny's 250 steps
    assert parse_args_to_config(recipe, []).optimizer.schedule.warmup_steps == 25
    cfg = parse_args_to_config(recipe, ["train.steps=100"])
    assert cfg.train.steps == 100
    assert cfg.optimizer.schedule.warmup_steps == round(0.1 * 100)
    # the decay length, when given, is what the fraction is of (Megatron-LM: lr_warmup_fraction * lr_decay_iters)
    cfg = parse_args_to_config(recipe, ["--train-iters", "100", "--lr-decay-iters", "80"])
    assert cfg.optimizer.schedule.warmup_steps == round(0.1 * 80)


def test_same_result_as_the_flag_on_the_command_line(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "recipe: lm-tiny\nlr-warmup-fraction: 0.2\n")
    from_file = parse_args_to_config(recipe, ["--train-iters", "30"])
    from_line = parse_args_to_config("lm-tiny", ["--train-iters", "30", "--lr-warmup-fraction", "0.2"])
    assert from_file.optimizer.schedule.warmup_steps == from_line.optimizer.schedule.warmup_steps == 6


def test_a_later_warmup_overrides_the_files_fraction(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "recipe: lm-tiny\nlr-warmup-fraction: 0.1\n")
    assert parse_args_to_config(recipe, ["train.steps=100", "--lr-warmup-iters", "3"]).optimizer.schedule.warmup_steps == 3
    assert parse_args_to_config(recipe, ["train.steps=100", "schedule.warmup_steps=7"]).optimizer.schedule.warmup_steps == 7
    assert parse_args_to_config(recipe, ["train.steps=100", "--lr-warmup-fraction", "0.5"]).optimizer.schedule.warmup_steps == 50


def test_fraction_that_is_no_whole_step_of_the_new_length_is_refused(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "recipe: lm-tiny\nlr-warmup-fraction: 0.1\n")
    with pytest.raises(ValueError, match="lr-warmup-fraction.*r.yaml"):
        parse_args_to_config(recipe, ["train.steps=105"])


def test_nested_recipe_base_fraction_follows_the_child(tmp_path):
    _write(tmp_path / "base.yaml", "recipe: lm-tiny\nlr-warmup-fraction: 0.1\n")
    child = _write(tmp_path / "child.yaml", "recipe: base.yaml\ntrain:\n  steps: 40\n")
    assert parse_args_to_config(child, []).optimizer.schedule.warmup_steps == 4
    assert parse_args_to_config(child, ["train.steps=60"]).optimizer.schedule.warmup_steps == 6
    fixed = _write(tmp_path / "fixed.yaml", "recipe: base.yaml\nschedule:\n  warmup_steps: 7\n")
    assert parse_args_to_config(fixed, ["train.steps=60"]).optimizer.schedule.warmup_steps == 7


def test_lr_in_the_file_is_the_lr_of_the_optimizer_that_runs(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "recipe: lm-tiny\nlr: 1.0e-3\n")
    assert parse_args_to_config(recipe, []).optimizer.logra.lr == 1e-3
    cfg = parse_args_to_config(recipe, ["--optimizer", "adam"])
    assert cfg.optimizer.name == "adam"
    assert cfg.optimizer.native.lr == 1e-3  # dense AdamW reads optimizer.native.lr
    # as the same line with --lr does
    assert parse_args_to_config("lm-tiny", ["--lr", "1e-3", "--optimizer", "adam"]).optimizer.native.lr == 1e-3
    # a lr the command line sets itself wins
    assert parse_args_to_config(recipe, ["--optimizer", "adam", "native.lr=5e-4"]).optimizer.native.lr == 5e-4
    assert parse_args_to_config(recipe, ["--optimizer", "adam", "--lr", "2e-3"]).optimizer.native.lr == 2e-3
