"""A ``jsonl:`` prompt too long for ``model.seq_length`` is refused at start naming ``PATH:LINE`` of the longest one
and how many of the file's prompts do not fit, like every other refusal of a file's rows. Before, the error
named only the token count and the prompt's first 60 characters: in a file of thousands of similar rows the
user could not find the row.

The token count of the reference is the recipe's own tokenizer run directly on the templated prompt (BOS, then
``rl.prompt_template`` around the text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.rl.components import check_config


def _write(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_the_longest_prompt_is_named_by_file_and_line(tmp_path):
    short = [f"What is {i} + 1?" for i in range(6)]
    first = _write(tmp_path / "first.jsonl", short)
    longest = "What is " + " + ".join(["1"] * 40) + "?"
    long_too = "What is " + " + ".join(["2"] * 25) + "?"
    second = _write(tmp_path / "second.jsonl", short[:2] + [longest] + short[2:4] + [long_too])
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "model.seq_length=48",
                                        f"task.datasets=jsonl:{first},jsonl:{second}", "task.num_eval=0"])
    tok = load_tokenizer(cfg.tokenizer.path)
    tokens = 1 + len(tok(cfg.rl.prompt_template.replace("{prompt}", longest), add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError) as exc:
        check_config(cfg)
    message = str(exc.value)
    assert message.startswith(f"{second}:3: a prompt of {tokens} tokens does not fit: model.seq_length=48 "), message
    assert f"(2 of the 6 prompts of 'jsonl:{second}' do not fit; the longest is on this line)" in message
