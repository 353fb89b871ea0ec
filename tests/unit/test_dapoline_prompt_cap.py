"""``task.max_prompt_tokens`` (slime's ``--rollout-max-prompt-len``): the train stream skips prompts longer than it,
counted as the policy reads them, as it skips those that do not fit the model; a ``jsonl:`` file's longer rows are
skipped, not refused; the held-out set is not limited by it."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config
from support.jsonl_rows import write_rows
from support.run_fixtures import LONGER_CHAIN_SUM, task_and_tokenizer

LONGER = LONGER_CHAIN_SUM  # prompts of 20, 24, 28, 32 and 36 tokens
CAP = 28
N = 120


def test_the_flag_sets_the_field_and_a_bad_value_names_it():
    assert parse_args_to_config("tiny", ["--rollout-max-prompt-len", "512"]).task.max_prompt_tokens == 512
    assert parse_args_to_config("tiny", []).task.max_prompt_tokens == 0
    with pytest.raises(ValueError, match=r"task\.max_prompt_tokens=-1 must be a whole number >= 0"):
        parse_args_to_config("tiny", ["task.max_prompt_tokens=-1"])


def test_training_prompts_above_the_cap_are_skipped_and_held_out_ones_kept(tmp_path, caplog):
    from megatron_logra.rl.loop import rl_prompt_ids

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.dataset_kwargs={LONGER}",
                                        "task.num_eval=40", "--rollout-max-prompt-len", str(CAP)])
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.task"):
        task, tok = task_and_tokenizer(cfg, tmp_path)
        drawn = [task.train_problem(i) for i in range(N)]
    plain, _ = task_and_tokenizer(parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "task.num_eval=40",
                                                   f"task.dataset_kwargs={LONGER}"]), tmp_path)

    def length(prompt: str) -> int:
        return len(rl_prompt_ids(tok, cfg.rl, prompt))

    unfiltered = [length(plain.train_problem(i).prompt) for i in range(N)]
    assert min(unfiltered) <= CAP < max(unfiltered)  # the config exercises both cases
    assert all(length(p.prompt) <= CAP for p in drawn)
    assert task.overlong_skips["chain_sum"] >= sum(n > CAP for n in unfiltered) > 0
    (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert f"is longer than task.max_prompt_tokens={CAP}" in warning and "raise task.max_prompt_tokens" in warning
    # the held-out set keeps its longer prompts (slime's evaluation prompts have a cap of their own)
    held_out = [length(p.prompt) for p in task.eval_problems()]
    assert held_out == [length(p.prompt) for p in plain.eval_problems()] and max(held_out) > CAP


def test_a_jsonl_row_above_the_cap_is_skipped_not_refused(tmp_path):
    from megatron_logra.rl.components import check_config

    short = [f"what is {i} plus {i} ?" for i in range(40)]
    long = "what is " + " plus ".join(str(i % 10) for i in range(40)) + " ?"  # past the tiny model's room
    spec = write_rows(tmp_path / "rows.jsonl", [(p, "1") for p in short + [long]])
    args = [f"train.run_dir={tmp_path / 'run'}", f"task.datasets={spec}", "task.reward=math_verify",
            "task.num_eval=0"]
    with pytest.raises(ValueError, match=r"rows\.jsonl:41: .*do not fit"):  # without the cap: refused at start
        check_config(parse_args_to_config("tiny", args))
    cfg = parse_args_to_config("tiny", [*args, "task.max_prompt_tokens=20"])
    task, _ = task_and_tokenizer(cfg, tmp_path)
    assert long not in {task.train_problem(i).prompt for i in range(200)}
    assert task.overlong_skips[spec] > 0
