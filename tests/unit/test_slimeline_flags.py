"""slime's own flags (its launch scripts' GRPO, rollout, evaluation, SGLang, W&B and cluster arguments): each one is
applied, accepted with a warning saying why, or refused naming what to use, and every refused flag of a pasted line
is reported in one error.

The launch line below is the arguments of slime's ``scripts/run-qwen3-4B.sh`` (its ROLLOUT, EVAL, PERF, GRPO,
SGLANG and MISC arrays and the cluster flags of its ``train.py`` call) with the data paths and the model sizes
replaced; ``--optimizer adam``, ``--lr``, ... are left out (the LoGRA recipe refuses them, tested elsewhere)."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config
from tests.support.cli import exit_2

SLIME_LINE = [
    "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "512", "--rollout-temperature", "0.8", "--global-batch-size", "256",
    "--balance-data", "--eval-interval", "20", "--n-samples-per-eval-prompt", "16", "--eval-temperature", "0.6",
    "--eval-max-response-len", "1024", "--eval-top-p", "0.7",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu", "9216",
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "unfused",
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", "--rollout-seed", "42",
]


def test_slimes_qwen3_launch_line_is_applied_field_by_field(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_args_to_config("qwen2.5-1.5b", SLIME_LINE)
    rl = cfg.rl
    assert (rl.steps, rl.prompts_per_step, rl.group_size, rl.eval_interval) == (3000, 32, 8, 20)
    assert (rl.rollout.temperature, rl.rollout.max_new_tokens, rl.rollout.eval_samples) == (0.8, 512, 16)
    assert (rl.rollout.eval_temperature, rl.rollout.eval_top_p, rl.rollout.eval_max_new_tokens) == (0.6, 0.7, 1024)
    assert (rl.rollout.mem_fraction_static, rl.rollout.sglang_tp) == (0.7, 2)
    assert (rl.loss.kind, rl.loss.clip_low, rl.loss.clip_high) == ("ppo", 0.2, 0.28)  # slime's PPO-clip loss
    assert (rl.loss.kl_coef, rl.loss.kl_estimator, rl.advantage.estimator) == (0.0, "low_var_kl", "grpo")
    assert (cfg.task.seed, cfg.task.reward, cfg.task.jsonl_prompt_key) == (42, "math_verify", "prompt")
    assert (cfg.parallel.tp, cfg.model.recompute, cfg.model.transformer_impl) == (2, "full", "local")
    assert cfg.task.eval_seed == 4321  # --rollout-seed moves the prompt stream, not the held-out set
    assert rl.max_tokens_per_micro_batch == 9216  # --use-dynamic-batch-size --max-tokens-per-gpu 9216
    warned = " ".join(r.getMessage() for r in caplog.records)
    for flag in ("--rollout-shuffle", "--balance-data", "--colocate", "--actor-num-nodes 1", "--rm-type deepscaler"):
        assert flag in warned, flag


def test_use_tis_chooses_the_tis_loss_and_keeps_the_clip_range_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_args_to_config("tiny", ["--eps-clip", "0.1", "--use-tis", "--tis-clip", "3", "--eps-clip-high",
                                            "0.3"])
    assert (cfg.rl.loss.kind, cfg.rl.loss.tis_cap, cfg.rl.loss.clip_low, cfg.rl.loss.clip_high) == ("tis", 3.0, 0.1,
                                                                                                    0.3)
    assert sum("accepted with --use-tis" in r.getMessage() for r in caplog.records) == 2


def test_eps_clip_against_a_tis_loss_given_on_the_line_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"--eps-clip sets rl\.loss\.clip_low.*rl\.loss\.kind=tis.*does not read it"):
        parse_args_to_config("tiny", ["rl.loss.kind=tis", "--eps-clip", "0.2"])
    cfg = parse_args_to_config("tiny", ["rl.loss.kind=ppo", "--eps-clip-high", "0.3"])
    assert (cfg.rl.loss.kind, cfg.rl.loss.clip_high) == ("ppo", 0.3)
    with pytest.raises(ValueError, match="job=lm does not have"):
        parse_args_to_config("lm-tiny", ["--eps-clip", "0.2"])


@pytest.mark.parametrize("args, field, value", [
    (["--disable-grpo-std-normalization"], ("rl", "advantage", "scale_by_std"), False),
    (["--normalize-advantages"], ("rl", "advantage", "normalize"), True),
    (["--custom-rm-path", "my_pkg.rm.score"], ("task", "reward"), "slime:my_pkg.rm.score"),
    (["--rm-type", "math"], ("task", "reward"), "math_verify"),
    (["--rm-type", "dapo"], ("task", "reward"), "math_verify"),
    (["--attention-backend", "local"], ("model", "transformer_impl"), "local"),
    (["--attention-backend", "auto"], ("model", "transformer_impl"), "auto"),
    (["--wandb-project", "p", "--wandb-group", "sweep-1", "--wandb-team", "lab"], ("train", "wandb_group"), "sweep-1"),
    (["--wandb-project", "p", "--wandb-team", "lab"], ("train", "wandb_entity"), "lab"),
    (["--wandb-project", "p", "--use-wandb"], ("train", "wandb_project"), "p"),
    (["--entropy-coef", "0.01"], ("rl", "loss", "entropy_coef"), 0.01),
    (["--train-backend", "megatron"], ("rl", "loss", "kind"), "tis"),
])
def test_a_slime_flag_sets_its_field(args, field, value):
    node = parse_args_to_config("tiny", args)
    for part in field:
        node = getattr(node, part)
    assert node == value


@pytest.mark.parametrize("args, match", [
    (["--advantage-estimator", "reinforce_plus_plus"], r"grpo.*rl\.advantage\.estimator=reinforce"),
    (["--rm-type", "remote_rm"], r"--rm-url"),
    (["--rm-type", "f1"], r"task\.reward=package\.module:function"),
    (["--attention-backend", "sdpa"], r"choose flash or fused"),
    (["--entropy-coef", "-0.1"], r"rl\.loss\.entropy_coef"),
    (["--use-wandb"], r"--wandb-project NAME"),
    (["--wandb-key", "abc"], r"WANDB_API_KEY"),
    (["--eval-max-response-len", "-1"], r"rl\.rollout\.eval_max_new_tokens"),
    (["--eval-top-p", "0"], r"rl\.rollout\.eval_top_p=0.*\(0, 1\]"),
    (["--custom-rm-path", ""], r"needs the reward function's path"),
    (["--partial-rollout"], r"a slime flag.*completes within the step"),
    (["--sglang-enable-dp-attention"], r"rl\.rollout\.sglang_engine_args=\{enable_dp_attention: VALUE\}"),
    (["--sglang-router-ip", "1.2.3.4"], r"slime's router"),
])
def test_a_slime_flag_without_that_meaning_here_is_refused_naming_what_to_use(args, match):
    with pytest.raises(ValueError, match=match):
        parse_args_to_config("tiny", args)


def test_every_refused_flag_of_a_line_is_reported_in_one_error(capsys):
    line = ["--rollout-batch-size", "4", "--eval-prompt-data", "aime", "/data/aime.jsonl", "--no-such-flag",
            "--partial-rollout", "rl.steps=3", "--entropy-coef", "lots", "--rl.group_size", "two"]
    with pytest.raises(ValueError) as err:
        parse_args_to_config("tiny", line)
    text = str(err.value)
    assert text.startswith("5 of the command line's options cannot be used")
    for part in ("--eval-prompt-data", "unknown option --no-such-flag", "--partial-rollout", "--entropy-coef",
                 "rl.group_size"):
        assert part in text, part
    assert "cannot parse override '/data/aime.jsonl'" not in text  # the refused flag's second value is its own
    assert "error: 5 of the command line's options cannot be used" in exit_2(["config", "tiny", *line], capsys)


def test_one_refused_flag_is_reported_as_before():
    with pytest.raises(ValueError) as err:
        parse_args_to_config("tiny", ["--rollout-batch-size", "4", "--partial-rollout"])
    assert str(err.value).startswith("--partial-rollout is a slime flag this trainer cannot honour")
