"""slime and Megatron-LM launch lines: slime's rollout flags set the RL job's fields of the same meaning,
``--global-batch-size`` of an RL launch is checked against the sequences of one RL step, ``--lr-warmup-fraction``
becomes ``optimizer.schedule.warmup_steps`` as Megatron-LM computes it, and the well-known flags without a
counterpart (``--exit-interval``, ``--train-samples``, ``--hf-checkpoint``, ``--ref-load``, ...) are refused
naming the field to use instead of being reported as unknown options."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.cli import main
from megatron_logra.config import parse_args_to_config

# ---------------------------------------------------------------------------- slime's rollout flags


@pytest.mark.parametrize("flag, value, field, expected", [
    ("--num-rollout", "3", ("rl", "steps"), 3),
    ("--rollout-batch-size", "4", ("rl", "prompts_per_step"), 4),
    ("--n-samples-per-prompt", "4", ("rl", "group_size"), 4),
    ("--rollout-max-response-len", "5", ("rl", "rollout", "max_new_tokens"), 5),
    ("--rollout-temperature", "0.8", ("rl", "rollout", "temperature"), 0.8),
    ("--rollout-top-p", "0.9", ("rl", "rollout", "top_p"), 0.9),
    ("--n-samples-per-eval-prompt", "2", ("rl", "rollout", "eval_samples"), 2),
    ("--vocab-size", "176", ("model", "vocab_size"), 176),
])
def test_a_slime_flag_sets_its_field(flag, value, field, expected):
    extra = ["--eval-temperature", "0.6"] if flag == "--n-samples-per-eval-prompt" else []
    cfg = parse_args_to_config("tiny", [flag, value, *extra])
    node = cfg
    for part in field:
        node = getattr(node, part)
    assert node == expected


def test_a_slime_launch_line_sets_the_rl_step():
    cfg = parse_args_to_config("tiny", [
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "6", "--rollout-temperature", "0.8", "--global-batch-size", "16",
        "--num-steps-per-rollout", "1", "--eval-temperature", "0.5", "--micro-batch-size", "8"])
    rl = cfg.rl
    assert (rl.steps, rl.prompts_per_step, rl.group_size, rl.micro_batch_size) == (3, 4, 4, 8)
    assert (rl.rollout.max_new_tokens, rl.rollout.temperature, rl.rollout.eval_temperature) == (6, 0.8, 0.5)
    assert cfg.train.global_batch_size == 32  # untouched: the lm job's field


def test_apply_chat_template_sets_the_rl_field():
    assert parse_args_to_config("tiny", ["--apply-chat-template"]).rl.chat_template is True
    with pytest.raises(ValueError, match="takes no value"):
        parse_args_to_config("tiny", ["--apply-chat-template=true"])


@pytest.mark.parametrize("args, first, second", [
    (["--num-rollout", "3", "--train-iters", "5"], "--num-rollout 3", "--train-iters 5"),
    (["--rollout-batch-size", "4", "rl.prompts_per_step=8"], "--rollout-batch-size 4", "rl.prompts_per_step=8"),
    (["--n-samples-per-prompt", "4", "--rl.group_size", "2"], "--n-samples-per-prompt 4", "--rl.group_size 2"),
])
def test_a_slime_flag_and_its_dotted_twin_at_different_values_are_refused(args, first, second):
    with pytest.raises(ValueError, match="another value|different values") as err:
        parse_args_to_config("tiny", args)
    assert first in str(err.value) and second in str(err.value)


def test_a_slime_flag_with_the_lm_job_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"rl\.prompts_per_step.*lm job does not read it"):
        parse_args_to_config("lm-tiny", ["--rollout-batch-size", "4"])


# ---------------------------------------------------------------------------- --global-batch-size of the RL job


def test_rl_global_batch_size_equal_to_one_step_is_accepted():
    cfg = parse_args_to_config("tiny", ["--global-batch-size", "128"])  # tiny: 16 prompts × 8 samples
    assert (cfg.rl.prompts_per_step, cfg.rl.group_size) == (16, 8)
    # order does not matter: checked after the flags that set the step
    cfg = parse_args_to_config("tiny", ["--global-batch-size", "16", "--rollout-batch-size", "4",
                                        "--n-samples-per-prompt", "4"])
    assert (cfg.rl.prompts_per_step, cfg.rl.group_size) == (4, 4)


def test_rl_global_batch_size_of_another_value_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"--global-batch-size 64.*16 × 8 = 128.*rl\.prompts_per_step"):
        parse_args_to_config("tiny", ["--global-batch-size", "64"])


def test_lm_global_batch_size_still_sets_the_lm_field():
    assert parse_args_to_config("lm-tiny", ["--global-batch-size", "64"]).train.global_batch_size == 64


def test_several_steps_per_rollout_are_refused():
    with pytest.raises(ValueError, match="--num-steps-per-rollout=2"):
        parse_args_to_config("tiny", ["--num-steps-per-rollout", "2"])


# ---------------------------------------------------------------------------- --lr-warmup-fraction


@pytest.mark.parametrize("recipe, args, warmup", [
    ("tiny", ["--lr-warmup-fraction", "0.1"], 6),  # of rl.steps=60
    ("lm-tiny", ["--lr-warmup-fraction", "0.1", "--train-iters", "50"], 5),  # of train.steps, in any order
    ("lm-tiny", ["--lr-warmup-fraction", "0.01", "--lr-decay-iters", "1000", "--lr-decay-style", "cosine"], 10),
    ("lm-tiny", ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "25"], 25),  # of 250 steps, twice: fine
])
def test_lr_warmup_fraction_sets_warmup_steps_of_the_decay_length(recipe, args, warmup):
    assert parse_args_to_config(recipe, args).optimizer.schedule.warmup_steps == warmup


def test_lr_warmup_fraction_of_no_whole_step_count_names_lr_warmup_iters():
    with pytest.raises(ValueError, match=r"4\.2 steps.*--lr-warmup-iters 4 or 5"):
        parse_args_to_config("tiny", ["--lr-warmup-fraction", "0.07"])


def test_lr_warmup_fraction_and_other_warmup_iters_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"--lr-warmup-iters 5.*--lr-warmup-fraction 0\.1 \(6\)"):
        parse_args_to_config("tiny", ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"])


# ---------------------------------------------------------------------------- flags without a counterpart


@pytest.mark.parametrize("args, match", [
    (["--exit-interval", "5"], r"--train-iters N with --lr-decay-iters TOTAL.*exit_duration_minutes"),
    (["--train-samples", "1000"], r"--train-iters N \(job=lm: train\.steps"),
    (["--lr-warmup-samples", "100"], r"--lr-warmup-iters N \(optimizer\.schedule\.warmup_steps\)"),
    (["--lr-decay-samples", "100"], r"--lr-decay-iters N \(optimizer\.schedule\.decay_steps\)"),
    (["--hf-checkpoint", "/ckpt/Qwen"], r"model\.hf_path=DIR"),
    (["--ref-load", "/ckpt/q_torch_dist"], r"model\.hf_path's weights.*--load RUN_DIR"),
    (["--prompt-data", "/data/dapo.jsonl"], r"task\.datasets: jsonl:PATH"),
    (["--eval-prompt-data", "aime", "/data/aime.jsonl"], r"task\.eval_datasets=jsonl:PATH\[,jsonl:PATH2\]"),
])
def test_a_well_known_flag_without_a_counterpart_is_refused_naming_what_to_use(args, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_args_to_config("tiny", args)
    assert "cannot honour" in str(err.value) and "unknown option" not in str(err.value)


def test_attention_softmax_in_fp32_is_already_in_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.args"):
        cfg = parse_args_to_config("tiny", ["--attention-softmax-in-fp32", "--seed", "7"])
    assert cfg.train.seed == 7
    assert any("--attention-softmax-in-fp32 is accepted and ignored" in r.getMessage() for r in caplog.records)


def test_help_names_the_new_flags(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt", "--rollout-max-response-len",
                 "--apply-chat-template", "--lr-warmup-fraction", "--num-steps-per-rollout", "--exit-interval",
                 "--hf-checkpoint", "--attention-softmax-in-fp32"):
        assert flag in out, flag


# ---------------------------------------------------------------------------- --log-interval of the RL job


def _log_interval_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "megatron_logra.config.checks" and "train.log_interval" in r.getMessage()]


def test_log_interval_with_the_rl_progress_bar_warns_that_it_has_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.checks"):
        cfg = parse_args_to_config("tiny", ["--log-interval", "1"])
    assert cfg.train.log_interval == 1 and cfg.train.progress
    (message,) = _log_interval_warnings(caplog)
    assert "--log-interval" in message and "train.progress=false" in message


@pytest.mark.parametrize("recipe, args", [
    ("tiny", ["--log-interval", "1", "train.progress=false"]),  # the RL job logs every step
    ("lm-tiny", ["--log-interval", "1"]),  # the lm job logs with its bar on
    ("tiny", []),  # the recipe's own interval is not the user's
])
def test_log_interval_that_takes_effect_does_not_warn(recipe, args, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.checks"):
        parse_args_to_config(recipe, args)
    assert not _log_interval_warnings(caplog)


def test_selective_recompute_is_refused_naming_full():
    with pytest.raises(ValueError, match=r"selective recompute .* not supported; choose full \(model\.recompute=full"):
        parse_args_to_config("tiny", ["--recompute-granularity", "selective"])
    assert parse_args_to_config("tiny", ["--recompute-granularity", "full"]).model.recompute == "full"
