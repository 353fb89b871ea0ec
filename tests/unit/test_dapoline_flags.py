"""A DAPO-style slime launch line (slime's scripts: dynamic sampling with the nonzero-std filter, over-sampling,
KL off, a prompt length cap, pass-rate logging) parses here, each flag with slime's meaning: the fields it sets,
the reasons it logs, and the refusals of the values this trainer cannot honour."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.megatron_flags.slime import FILTER_ROUNDS

FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
DAPO_LINE = (f"--over-sampling-batch-size 64 --dynamic-sampling-filter-path {FILTER} --num-steps-per-rollout 1 "
             "--balance-data --log-probs-max-tokens-per-gpu 8192 --kl-coef 0.00 --use-kl-loss --kl-loss-coef 0.00 "
             "--kl-loss-type low_var_kl --entropy-coef 0.00 --rollout-max-prompt-len 1024 --log-passrate "
             "--update-weights-interval 1 --rollout-batch-size 32 --n-samples-per-prompt 8 "
             "--global-batch-size 256").split()


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_the_whole_dapo_line_parses_with_slimes_meaning(caplog):
    with caplog.at_level(logging.INFO):
        cfg = parse_args_to_config("qwen2.5-1.5b", DAPO_LINE)
    assert cfg.rl.dynamic_sampling_rounds == FILTER_ROUNDS == 4  # the filter, bounded
    assert cfg.task.max_prompt_tokens == 1024
    assert (cfg.rl.prompts_per_step, cfg.rl.group_size) == (32, 8)
    assert cfg.rl.loss.kl_coef == 0.0 and cfg.rl.loss.kl_estimator == "low_var_kl"
    assert cfg.rl.loss.entropy_coef == 0.0 and cfg.rl.advantage.estimator == "grpo"
    logged = _messages(caplog)
    assert f"dynamic sampling is on with rl.dynamic_sampling_rounds={FILTER_ROUNDS}" in logged
    assert "no bound" in logged  # why a bound was chosen
    assert "--over-sampling-batch-size 64 is accepted" in logged and "rl.prompts_per_step=32" in logged
    assert "--log-probs-max-tokens-per-gpu 8192 is accepted" in logged and "rl.loss.logprob_chunk_tokens" in logged
    assert "--log-passrate is accepted" in logged and "pass_at_group" in logged


def test_the_filter_keeps_the_rounds_the_line_gives():
    cfg = parse_args_to_config("tiny", ["rl.dynamic_sampling_rounds=2", "--dynamic-sampling-filter-path", FILTER])
    assert cfg.rl.dynamic_sampling_rounds == 2
    cfg = parse_args_to_config("tiny", ["--dynamic-sampling-filter-path", "my.own.copy:check_reward_nonzero_std",
                                        "rl.dynamic_sampling_rounds=7"])
    assert cfg.rl.dynamic_sampling_rounds == 7  # any module path; the line's rounds wherever they are


def test_the_filter_against_rounds_zero_on_the_line_is_refused():
    with pytest.raises(ValueError, match=r"turns dynamic sampling on, but rl\.dynamic_sampling_rounds=0 turns it off"):
        parse_args_to_config("tiny", ["--dynamic-sampling-filter-path", FILTER, "rl.dynamic_sampling_rounds=0"])


def test_another_filter_is_refused_naming_the_one_that_maps():
    with pytest.raises(ValueError, match=r"only slime's check_reward_nonzero_std filter .* maps here") as err:
        parse_args_to_config("tiny", ["--dynamic-sampling-filter-path", "examples.reward_cap_filter.check_reward_cap"])
    assert "rl.dynamic_sampling_rounds=N" in str(err.value)


def test_the_filter_is_refused_without_grpo_and_in_the_lm_job():
    with pytest.raises(ValueError, match=r"rl\.advantage\.estimator=reinforce.*--advantage-estimator grpo"):
        parse_args_to_config("tiny", ["rl.advantage.estimator=reinforce", "--dynamic-sampling-filter-path", FILTER])
    with pytest.raises(ValueError, match=r"job=lm does not have"):
        parse_args_to_config("lm-tiny", ["--dynamic-sampling-filter-path", FILTER])


def test_over_sampling_follows_slime_without_a_filter(caplog):
    # slime's default (--rollout-batch-size prompts per rollout) is what each step draws here: accepted
    with caplog.at_level(logging.INFO, logger="megatron_logra.megatron_flags.dynamic_sampling"):
        cfg = parse_args_to_config("tiny", ["--over-sampling-batch-size", "16", "--rollout-batch-size", "16"])
    assert cfg.rl.dynamic_sampling_rounds == 0 and "is accepted" in _messages(caplog)
    # more prompts than the batch needs, with no filter to drop groups: refused, naming the filter
    with pytest.raises(ValueError, match=r"dynamic sampling is off here.*--dynamic-sampling-filter-path "
                                         r"slime\.rollout\.filter_hub"):
        parse_args_to_config("tiny", ["--over-sampling-batch-size", "64", "--rollout-batch-size", "16"])
    # below the batch, which slime asserts against too
    with pytest.raises(ValueError, match=r"below --rollout-batch-size \(rl\.prompts_per_step=16\)"):
        parse_args_to_config("tiny", ["--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "8",
                                      "--rollout-batch-size", "16"])


def test_over_sampling_is_accepted_with_the_recipes_dynamic_sampling():
    cfg = parse_args_to_config("tiny", ["rl.dynamic_sampling_rounds=3", "--over-sampling-batch-size", "64",
                                        "--rollout-batch-size", "16"])
    assert cfg.rl.dynamic_sampling_rounds == 3


def test_kl_coef_and_update_weights_interval_are_accepted_at_their_neutral_value_only():
    cfg = parse_args_to_config("tiny", ["--kl-coef", "0", "--update-weights-interval", "1"])
    assert cfg.rl.loss.kl_coef == 0.0
    with pytest.raises(ValueError, match=r"--kl-coef=0\.01: a KL penalty in the reward is not supported.*"
                                         r"rl\.loss\.kl_coef=C"):
        parse_args_to_config("tiny", ["--kl-coef", "0.01"])
    with pytest.raises(ValueError, match=r"--update-weights-interval=2: the rollout engine's weights are synced "
                                         r".* after every RL step"):
        parse_args_to_config("tiny", ["--update-weights-interval", "2"])


def test_every_refused_flag_of_the_line_is_reported_at_once():
    line = [w if w != FILTER else "my.filters.keep_all" for w in DAPO_LINE]
    line[line.index("--update-weights-interval") + 1] = "4"
    with pytest.raises(ValueError, match=r"^3 of the command line's options cannot be used") as err:
        parse_args_to_config("qwen2.5-1.5b", line)
    message = str(err.value)
    assert "my.filters.keep_all" in message and "--update-weights-interval=4" in message
    # without the filter dynamic sampling is off, so the over-sampling that slime does for it is refused too
    assert "--over-sampling-batch-size 64: slime draws more prompts" in message


@pytest.mark.parametrize("flag, value, whose", [
    ("--hf-checkpoint", "/ckpt/Qwen", "a slime flag"),
    ("--prompt-data", "/data/dapo.jsonl", "a slime flag"),
    ("--loss-type", "custom_loss", "a slime flag"),
    ("--data-path", "/data/x", "a Megatron-LM flag"),
    ("--num-experts", "8", "a Megatron-LM flag"),
])
def test_a_refusal_names_whose_flag_it_is(flag, value, whose):
    with pytest.raises(ValueError, match=rf"^{flag} is {whose} this trainer cannot honour"):
        parse_args_to_config("tiny", [flag, value])
