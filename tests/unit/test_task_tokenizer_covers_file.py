"""A tokenizer built for the task (``tokenizer.path`` empty) covers every character of a ``jsonl:`` file: all its
rows, train and held-out alike, not only the first 64 problems the train stream draws. Before, a character
that only rows outside those draws held (here one Greek letter per row, 24 of them over 120 rows) encoded to
``<unk>``, silently, in training prompts and in the held-out set alike.

The reference is the file itself: every prompt and answer must encode without ``<unk>`` and decode back to its
own text (the character and word tokenizers round-trip known characters exactly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rewards import build_task
from megatron_logra.rl.warm_start import run_tokenizer

GREEK = [chr(0x3B1 + i) for i in range(24)]


@pytest.fixture
def greek_file(tmp_path: Path) -> Path:
    path = tmp_path / "greek.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} {GREEK[i % 24]}{i}?", "answer": str(i)},
                                       ensure_ascii=False) + "\n" for i in range(120)), encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["char", "words"])
def test_every_character_of_the_file_has_a_token(greek_file, tmp_path, kind):
    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{greek_file}", "tokenizer.path=",
                                        f"tokenizer.kind={kind}", "model.vocab_size=512", "sft.init_path="])
    task = build_task(cfg.task)
    tok = run_tokenizer(cfg, task, tmp_path / "run", will_save=False)
    (source,) = task.sources
    assert len(source.problems) == 120
    assert {ch for ch in GREEK} <= set(tok.get_vocab())
    for problem in source.problems:
        for text in (problem.prompt, problem.answer):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids, (problem.metadata["line"], text)
            assert tok.decode(ids) == text
