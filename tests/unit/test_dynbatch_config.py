"""``rl.max_tokens_per_micro_batch``: bad values and pipeline parallelism are refused naming the field and the fix,
and the memory preflight plans a dynamic micro-batch as the budget's worth of full-length sequences."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.memory.preflight import fit_hint, rl_micro_batch, run_plan_config
from megatron_logra.rl.batch_layout import check_rl_batch_layout


@pytest.mark.parametrize("value", ["-1", "true", "1.5"])
def test_a_budget_that_is_not_a_whole_number_is_refused(value):
    with pytest.raises(ValueError, match="rl.max_tokens_per_micro_batch"):
        parse_args_to_config("tiny", [f"rl.max_tokens_per_micro_batch={value}"])


def test_pipeline_parallelism_is_refused_with_the_fix():
    cfg = parse_args_to_config("tiny", ["rl.max_tokens_per_micro_batch=512"])
    check_rl_batch_layout(cfg, dp_size=2, pp_size=1)
    with pytest.raises(ValueError, match=r"rl.max_tokens_per_micro_batch=512 .*parallel.pp=1"):
        check_rl_batch_layout(cfg, dp_size=1, pp_size=2)
    cfg.rl.max_tokens_per_micro_batch = 0
    check_rl_batch_layout(cfg, dp_size=1, pp_size=2)


def test_the_preflight_plans_the_budget_in_full_length_sequences():
    cfg = parse_args_to_config("tiny", ["sft.steps=0", "rl.prompts_per_step=16", "rl.group_size=8",
                                        "rl.micro_batch_size=64"])
    seq = cfg.model.seq_length
    assert rl_micro_batch(cfg, 1) == 64
    cfg.rl.max_tokens_per_micro_batch = 3 * seq + 1  # four sequences' worth, rounded up
    assert rl_micro_batch(cfg, 1) == 4
    cfg.rl.max_tokens_per_micro_batch = seq // 2  # less than one sequence: one is the least a micro-batch holds
    assert rl_micro_batch(cfg, 1) == 1
    cfg.rl.max_tokens_per_micro_batch = 1000 * seq  # never more than a rank's rows per step
    assert rl_micro_batch(cfg, 2) == 8 * 8
    cfg.rl.max_tokens_per_micro_batch = 3 * seq
    pcfg = run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=80 << 30)
    assert pcfg.micro_batch == 3
    assert f"rl.max_tokens_per_micro_batch={3 * seq}" in fit_hint(cfg, pcfg)


def test_a_training_warm_start_is_planned_by_the_budget_too():
    cfg = parse_args_to_config("tiny", ["sft.steps=10", "sft.init_path=", "sft.batch_size=32", "rl.prompts_per_step=2",
                                        "rl.group_size=2", "rl.micro_batch_size=16"])
    assert not cfg.model.hf_path
    assert rl_micro_batch(cfg, 1) == 16  # the warm start's 32 demonstrations, in micro-batches of 16
    cfg.rl.max_tokens_per_micro_batch = 1
    assert rl_micro_batch(cfg, 1) == 1
    cfg.rl.max_tokens_per_micro_batch = 6 * cfg.model.seq_length  # more than the RL step's 4 rows
    assert rl_micro_batch(cfg, 1) == 6


def test_slimes_dynamic_batch_flags_set_the_budget():
    cfg = parse_args_to_config("tiny", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"])
    assert cfg.rl.max_tokens_per_micro_batch == 4096
    assert parse_args_to_config("tiny", ["--max-tokens-per-gpu", "2048"]).rl.max_tokens_per_micro_batch == 2048
    with pytest.raises(ValueError, match="--use-dynamic-batch-size needs a token budget: give --max-tokens-per-gpu"):
        parse_args_to_config("tiny", ["--use-dynamic-batch-size"])
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        parse_args_to_config("tiny", ["--max-tokens-per-gpu", "-5"])
