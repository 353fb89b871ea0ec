"""``task.eval_max_prompt_tokens`` (slime's ``--eval-max-prompt-len``): the held-out set drops prompts longer than it,
counted as the policy reads them, and takes the next ones in its fixed order (the same set every time it is built,
as on every rank); training prompts are not limited by it; a benchmark row above it is dropped rather than refused,
and a benchmark with no held-out prompt within it is refused at start."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config
from support.jsonl_rows import write_rows
from support.run_fixtures import LONGER_CHAIN_SUM, task_and_tokenizer

LONGER = LONGER_CHAIN_SUM  # prompts of 20, 24, 28, 32 and 36 tokens
CAP = 28


def test_the_flag_sets_the_field_and_a_bad_value_names_it():
    assert parse_args_to_config("tiny", ["--eval-max-prompt-len", "512"]).task.eval_max_prompt_tokens == 512
    assert parse_args_to_config("tiny", ["--eval-max-prompt-len=64"]).task.eval_max_prompt_tokens == 64
    assert parse_args_to_config("tiny", []).task.eval_max_prompt_tokens == 0
    with pytest.raises(ValueError, match=r"task\.eval_max_prompt_tokens=-1 must be a whole number >= 0 .*"
                                         r"--eval-max-prompt-len"):
        parse_args_to_config("tiny", ["--eval-max-prompt-len", "-1"])


def test_held_out_prompts_above_the_cap_are_dropped_and_training_ones_kept(tmp_path, caplog):
    from megatron_logra.rl.loop import rl_prompt_ids

    base = [f"train.run_dir={tmp_path / 'run'}", f"task.dataset_kwargs={LONGER}", "task.num_eval=40"]
    cfg = parse_args_to_config("tiny", [*base, "--eval-max-prompt-len", str(CAP)])
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.task"):
        task, tok = task_and_tokenizer(cfg, tmp_path)
        held_out = task.eval_problems()
    plain, _ = task_and_tokenizer(parse_args_to_config("tiny", base), tmp_path)

    def length(prompt: str) -> int:
        return len(rl_prompt_ids(tok, cfg.rl, prompt))

    unfiltered = [length(p.prompt) for p in plain.eval_problems()]
    assert min(unfiltered) <= CAP < max(unfiltered)  # the config exercises both cases
    assert len(held_out) == len(unfiltered) == 40  # the next prompts take the dropped ones' places
    assert all(length(p.prompt) <= CAP for p in held_out)
    assert task.overlong_skips["chain_sum (held-out)"] > 0
    (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert f"is longer than task.eval_max_prompt_tokens={CAP}" in warning
    assert f"raise task.eval_max_prompt_tokens={CAP} (--eval-max-prompt-len)" in warning
    # built again (as every rank builds it): the same held-out problems, in the same order
    again, _ = task_and_tokenizer(cfg, tmp_path)
    assert [p.prompt for p in again.eval_problems()] == [p.prompt for p in held_out]
    # the train stream is not limited by it
    trained = [length(task.train_problem(i).prompt) for i in range(120)]
    assert max(trained) > CAP
    assert [p.prompt for p in (task.train_problem(i) for i in range(120))] == \
        [p.prompt for p in (plain.train_problem(i) for i in range(120))]


def _benchmark(tmp_path, prompts) -> str:
    return write_rows(tmp_path / "bench.jsonl", [(p, "1") for p in prompts])


def test_a_benchmark_row_above_the_cap_is_dropped_not_refused(tmp_path):
    from megatron_logra.rl.components import check_config

    short = [f"what is {i} plus {i} ?" for i in range(10)]
    long = "what is " + " plus ".join(str(i % 10) for i in range(40)) + " ?"  # past the tiny model's room
    spec = _benchmark(tmp_path, short + [long])
    args = [f"train.run_dir={tmp_path / 'run'}", f"task.eval_datasets={spec}", "task.num_eval=20"]
    with pytest.raises(ValueError, match=r"bench\.jsonl:11: "):  # without the cap: refused at start
        check_config(parse_args_to_config("tiny", args))
    task, _ = task_and_tokenizer(parse_args_to_config("tiny", [*args, "--eval-max-prompt-len", "20"]), tmp_path)
    prompts = [p.prompt for p in task.eval_problems()]
    assert long not in prompts and set(prompts) == set(short)


def test_a_benchmark_with_no_prompt_within_the_cap_is_refused(tmp_path):
    spec = _benchmark(tmp_path, [f"what is {i} plus {i} plus {i} ?" for i in range(5)])
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.eval_datasets={spec}",
                                        "task.num_eval=5", "--eval-max-prompt-len", "3"])
    with pytest.raises(ValueError, match=r"every one of the 5 held-out prompts of .* is longer than "
                                         r"task\.eval_max_prompt_tokens=3 .*raise task\.eval_max_prompt_tokens"):
        task_and_tokenizer(cfg, tmp_path)
