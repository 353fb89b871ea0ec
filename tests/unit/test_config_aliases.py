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


def test_rl_job_refuses_the_lm_batch_fields_and_the_lm_job_checks_them():
    with pytest.raises(ValueError, match=r"train\.micro_batch_size=64 is set.*rl\.micro_batch_size"):
        parse_args_to_config("tiny", ["train.micro_batch_size=64"])  # the RL job never reads it
    with pytest.raises(ValueError, match=r"train\.global_batch_size=32 must be a multiple of train\.micro_batch_size=64"):
        parse_args_to_config("lm-tiny", ["train.micro_batch_size=64"])


def test_yaml_recipe_flags_resolve_by_job(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: tiny\ntrain-iters: 7\nmicro-batch-size: 16\n")
    cfg = load_recipe(str(path))
    assert (cfg.rl.steps, cfg.rl.micro_batch_size) == (7, 16)


# ---------------------------------------------------------------- optimizer flags
def test_optimizer_flags_set_dense_adamw_fields_for_optimizer_adam():
    cfg = parse_args_to_config("tiny-adam", ["--lr", "0.5", "--weight-decay", "0.1", "--adam-beta1", "0.8",
                                             "--adam-beta2", "0.99", "--adam-eps", "1e-6", "--clip-grad", "2"])
    native = cfg.optimizer.native
    assert (native.lr, native.weight_decay, native.beta1, native.beta2, native.eps) == (0.5, 0.1, 0.8, 0.99, 1e-6)
    assert cfg.optimizer.logra.clip_grad == 2.0  # dense AdamW clips at logra.clip_grad
    assert cfg.optimizer.logra.lr == load_recipe("tiny-adam").optimizer.logra.lr
    # optimizer.name given anywhere on the line decides
    dense = ["kl.mode=none", "native.freeze=false"]  # dense AdamW reads neither (RunConfig refuses them)
    assert parse_args_to_config("tiny", ["--lr", "0.25", "--optimizer", "adam", *dense]).optimizer.native.lr == 0.25


def test_optimizer_flags_set_logra_fields_for_the_optimizer_recipe():
    cfg = parse_args_to_config("lm-tiny", ["--lr", "0.01", "--weight-decay", "0.1", "--clip-grad", "0.5",
                                           "--adam-beta2", "0.9"])
    logra = cfg.optimizer.logra
    assert (logra.lr, logra.weight_decay, logra.clip_grad) == (0.01, 0.1, 0.5)
    assert cfg.optimizer.native.beta2 == 0.9  # native AdamW of the (trained) non-target parameters


@pytest.mark.parametrize("flag, use", [
    ("--lr", r"logra\.update_ratio"),
    ("--weight-decay", r"native\.weight_decay"),
    ("--clip-grad", r"logra\.recipe=optimizer"),
])
def test_flags_the_paper_recipe_does_not_read_are_refused(flag, use):
    with pytest.raises(ValueError, match=rf"{flag} would set optimizer\.logra\.\w+, which logra\.recipe=paper does not "
                                         rf"use .*{use}"):
        parse_args_to_config("tiny", [flag, "0.1", "logra.recipe=paper"])


@pytest.mark.parametrize("flag, value, use", [
    ("--adam-beta1", "0.8", "no first moment"),
    ("--adam-beta2", "0.99", r"optimizer\.logra\.beta2"),
    ("--adam-eps", "1e-6", r"optimizer\.logra\.eps"),
])
def test_adam_flags_of_frozen_native_parameters_are_refused(flag, value, use):
    assert load_recipe("tiny").optimizer.native.freeze
    with pytest.raises(ValueError, match=rf"{flag} would set optimizer\.native\.\w+.*native\.freeze=true.*{use}"):
        parse_args_to_config("tiny", [flag, value])
    assert parse_args_to_config("tiny", [flag, value, "native.freeze=false"]).optimizer.native.freeze is False


def test_cli_refuses_an_unused_optimizer_flag_with_exit_2(capsys):
    from megatron_logra.cli import main

    with pytest.raises(SystemExit) as info:
        main(["config", "tiny", "--lr", "0.5", "logra.recipe=paper"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "logra.update_ratio" in err and "Traceback" not in err


# ---------------------------------------------------------------- --max-position-embeddings
@pytest.mark.parametrize("args", [
    ["--seq-length", "4096", "--max-position-embeddings", "32768"],
    ["--max-position-embeddings", "32768", "--seq-length", "4096"],
])
def test_max_position_embeddings_never_overwrites_seq_length(args):
    assert parse_args_to_config("qwen2.5-7b", args).model.seq_length == 4096


def test_max_position_embeddings_below_seq_length_or_sizing_a_learned_table_is_refused():
    with pytest.raises(ValueError, match=r"--max-position-embeddings=32 is below model\.seq_length=48"):
        parse_args_to_config("tiny", ["--max-position-embeddings", "32"])
    with pytest.raises(ValueError, match=r"learned_absolute .*model\.seq_length=48.*--seq-length 64"):
        parse_args_to_config("tiny", ["--max-position-embeddings", "64", "model.position_embedding_type=learned_absolute"])
    cfg = parse_args_to_config("tiny", ["--max-position-embeddings", "64", "--seq-length", "64",
                                        "model.position_embedding_type=learned_absolute"])
    assert cfg.model.seq_length == 64
