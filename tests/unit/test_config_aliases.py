"""Megatron-LM flag aliases set the field that the configured job and optimizer actually read, or are
refused naming the field to use (never silently set a field nothing reads)."""

from __future__ import annotations

import pytest

from megatron_logra.config import load_recipe, parse_args_to_config


# ---------------------------------------------------------------- job-dependent flags
def test_loop_flags_set_the_rl_fields_for_the_rl_job():
    cfg = parse_args_to_config("tiny", ["--train-iters", "5", "--micro-batch-size", "32", "--eval-interval=3"])
    assert (cfg.rl.steps, cfg.rl.micro_batch_size, cfg.rl.eval_interval) == (5, 32, 3)
    default = load_recipe("tiny").train
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.eval_interval) == (
        default.steps, default.micro_batch_size, default.eval_interval)


def test_loop_flags_set_the_train_fields_for_the_lm_job():
    cfg = parse_args_to_config("lm-tiny", ["--train-iters", "5", "--micro-batch-size", "4", "--global-batch-size", "8",
                                           "--eval-interval", "2"])
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.eval_interval) == (
        5, 4, 8, 2)
    assert cfg.rl.steps == load_recipe("lm-tiny").rl.steps


def test_the_job_anywhere_on_the_line_decides():
    assert parse_args_to_config("tiny", ["--train-iters", "5", "job=lm"]).train.steps == 5
    assert parse_args_to_config("lm-tiny", ["--train-iters", "5", "job=rl"]).rl.steps == 5


def test_global_batch_size_is_refused_for_rl_naming_the_rl_fields():
    with pytest.raises(ValueError, match=r"--global-batch-size .*rl\.prompts_per_step × rl\.group_size = 16 × 8 = 128"):
        parse_args_to_config("tiny", ["--global-batch-size", "64"])


def test_a_flag_and_the_field_it_sets_together_are_refused():
    with pytest.raises(ValueError, match=r"--train-iters sets rl\.steps .*also given"):
        parse_args_to_config("tiny", ["--train-iters", "5", "rl.steps=4"])


def test_rl_job_skips_the_lm_batch_check():
    cfg = parse_args_to_config("tiny", ["train.micro_batch_size=64"])  # 32 % 64: only the lm loop cares
    assert cfg.train.micro_batch_size == 64
    with pytest.raises(ValueError, match=r"train\.global_batch_size=32 must be a multiple of train\.micro_batch_size=64"):
        parse_args_to_config("lm-tiny", ["train.micro_batch_size=64"])


def test_yaml_recipe_flags_resolve_by_job(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: tiny\ntrain-iters: 7\nmicro-batch-size: 16\n")
    cfg = load_recipe(str(path))
    assert (cfg.rl.steps, cfg.rl.micro_batch_size) == (7, 16)
