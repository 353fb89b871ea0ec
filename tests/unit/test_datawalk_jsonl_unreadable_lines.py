"""A JSONL problem file whose line the ``json`` module cannot turn into Python values (an integer past Python's
4300-digit int-string limit, arrays nested deeper than the parser's recursion allows) is refused as any invalid line
is, with ``PATH:LINE``, not with a bare ``ValueError`` / ``RecursionError`` that names no file; and a byte that is
not UTF-8 is named at the line the reader counts, also in a file whose lines end with a lone ``\\r``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_logra.rewards import TaskConfig, build_task, load_jsonl_problems

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]


def _file(tmp_path: Path, last_line: str, newline: str = "\n") -> Path:
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(row) for row in ROWS] + [last_line]
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return path


def _refused_at(exc: pytest.ExceptionInfo, path: Path, line: int) -> None:
    assert f"{path}:{line}:" in str(exc.value), str(exc.value)


def test_an_integer_past_the_digit_limit_names_path_and_line(tmp_path):
    path = _file(tmp_path, '{"prompt": "big?", "answer": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError) as exc:
        load_jsonl_problems(path)
    _refused_at(exc, path, len(ROWS) + 1)
    with pytest.raises(ValueError) as exc:
        build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=4))
    _refused_at(exc, path, len(ROWS) + 1)


def test_nesting_too_deep_for_the_parser_names_path_and_line(tmp_path):
    depth = sys.getrecursionlimit() * 10
    path = _file(tmp_path, '{"prompt": "deep?", "answer": "1", "metadata": {"x": ' + "[" * depth + "]" * depth + "}}")
    with pytest.raises(ValueError) as exc:  # a RecursionError is no ValueError: it escaped as a traceback
        load_jsonl_problems(path)
    _refused_at(exc, path, len(ROWS) + 1)


def test_megatron_logra_config_refuses_the_deep_row_without_a_traceback(tmp_path):
    depth = 200_000
    path = _file(tmp_path, '{"prompt": "deep?", "answer": "1", "metadata": ' + "[" * depth + "]" * depth + "}")
    cli = Path(sys.executable).with_name("megatron-logra")
    done = subprocess.run([str(cli), "config", "tiny", f"task.datasets=jsonl:{path}"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and f"{path}:{len(ROWS) + 1}:" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_a_byte_that_is_not_utf8_is_named_at_its_line_whatever_the_line_ends(tmp_path, newline):
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(row).encode() for row in ROWS[:6]] + [b'{"prompt": "caf\xe9?", "answer": "1"}']
    path.write_bytes(newline.encode().join(lines) + newline.encode())
    with pytest.raises(ValueError) as exc:
        load_jsonl_problems(path)
    _refused_at(exc, path, 7)
    assert re.search(r"byte 0xe9 at byte column 16\b", str(exc.value)), str(exc.value)
    # the same file with the byte fixed: the reader itself puts that row on line 7
    path.write_bytes(path.read_bytes().replace(b"\xe9", b"e"))
    assert load_jsonl_problems(path)[-1].metadata["line"] == 7
