"""A ``jsonl:`` file whose rows hold characters the run's tokenizer has no token for (the ``tiny`` recipe's word
tokenizer knows printable ASCII only) is named at start: one warning with the file, the count of such rows, the
characters and the first lines. Before, such a prompt reached the policy with ``<unk>`` in place of the
characters (and such an answer could never be generated), and nothing said so.

The reference for which rows are named is the text itself: the rows with a character outside
``string.printable``."""

from __future__ import annotations

import json
import logging
import string
from pathlib import Path

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.components import check_config

ROWS = [("What is 2 + 2?", "4"), ("Combien font 2 + 3 ? Réponds", "5"), ("What is 3 + 3?", "6"),
        ("What is 1 + 1?", "2"), ("Half of 3?", "1½"), ("What is 9 - 1? 🙂", "8"), ("What is 7 + 0?", "7")]
ROWS += [(f"What is {i} + {i}?", str(2 * i)) for i in range(10, 40)]


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "uni.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}, ensure_ascii=False) + "\n" for p, a in ROWS),
                    encoding="utf-8")
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "has no token for" in r.getMessage()]


def test_rows_with_characters_the_tokenizer_lacks_are_named(tmp_path, caplog):
    path = _file(tmp_path)
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.datasets=jsonl:{path}",
                                        "task.num_eval=0"])
    expected = [i + 1 for i, (p, a) in enumerate(ROWS) if set(p + a) - set(string.printable)]
    assert expected == [2, 5, 6]
    with caplog.at_level(logging.WARNING):
        check_config(cfg)
    (message,) = _warnings(caplog)
    assert message.startswith(f"jsonl:{path}: 3 of its {len(ROWS)} rows hold characters "
                              f"tokenizer.path={cfg.tokenizer.path!r} has no token for ('½', 'é', '🙂'; lines 2, 5, 6)")


def test_a_file_the_tokenizer_covers_is_not_named(tmp_path, caplog):
    path = tmp_path / "ascii.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(30)))
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.datasets=jsonl:{path}",
                                        "task.num_eval=0"])
    with caplog.at_level(logging.WARNING):
        check_config(cfg)
    assert _warnings(caplog) == []


def test_a_tokenizer_built_for_the_file_covers_it(tmp_path, caplog):
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.datasets=jsonl:{_file(tmp_path)}",
                                        "task.num_eval=0", "tokenizer.path=", "sft.init_path="])
    with caplog.at_level(logging.WARNING):
        check_config(cfg)
    assert _warnings(caplog) == []
