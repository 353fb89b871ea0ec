"""A ``task.max_prompt_tokens`` below every training prompt of a source leaves it nothing to train on: the error at
start names that field as the fix, not ``model.seq_length`` / ``rl.rollout.max_new_tokens``, which do not help."""

from __future__ import annotations

import json

import pytest

from megatron_logra.config import parse_args_to_config


def _build(cfg, tmp_path):
    from megatron_logra.rl.components import _task_and_tokenizer

    return _task_and_tokenizer(cfg, tmp_path / "run", will_save=False)


def test_a_cap_below_every_generated_prompt_names_the_cap(tmp_path):
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "task.num_eval=0",
                                        "task.max_prompt_tokens=5"])
    with pytest.raises(ValueError, match="no training prompts that fit") as info:
        _build(cfg, tmp_path)
    message = str(info.value)
    fix = message.rsplit(" — ", 1)[1]
    assert "task.max_prompt_tokens" in fix, message
    assert "lower rl.rollout.max_new_tokens" not in fix, message
    # the same model without the cap trains: raising model.seq_length was never what it needed
    _build(parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "task.num_eval=0"]), tmp_path)


def test_a_cap_below_every_row_of_a_file_names_the_cap(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i} ?", "answer": str(2 * i)}) + "\n"
                            for i in range(40)))
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.datasets=jsonl:{path}",
                                        "task.reward=math_verify", "task.num_eval=0", "task.max_prompt_tokens=3"])
    with pytest.raises(ValueError, match="no training prompts that fit") as info:
        _build(cfg, tmp_path)
    fix = str(info.value).rsplit(" — ", 1)[1]
    assert "task.max_prompt_tokens" in fix and "lower rl.rollout.max_new_tokens" not in fix, str(info.value)
