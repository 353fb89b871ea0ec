"""A JSONL file's plain-number gold answers (integers, decimals: GSM8K's, DAPO-Math's) are known to parse without
running math-verify on each: loading a 20,000-row file took 20 s, almost all of it parsing answers. The shortcut
must say what math-verify says: each plain number below parses with math-verify itself, and anything else still
goes through it."""

from __future__ import annotations

import json
import random

import pytest
from math_verify import parse

from megatron_logra.rewards.math import parses_as_math

random.seed(7)
PLAIN = ["0", "7", "-3", "007", "42.5", "-0.125", " 12 ", "12\n", str(10 ** 40), "3.14159265358979",
         *(str(random.randint(-10 ** 6, 10 ** 6)) for _ in range(40)),
         *(f"{random.randint(0, 999)}.{random.randint(0, 999):03d}" for _ in range(20))]


@pytest.mark.parametrize("text", PLAIN)
def test_a_plain_number_is_one_math_verify_parses(text):
    assert parse("\\boxed{" + text.strip() + "}"), text  # the reference: math-verify itself
    assert parses_as_math(text)


@pytest.mark.parametrize("text, expected", [("\\frac{1}{2}", True), ("1,000", True), ("x^2+1", True),
                                            ("", False), ("   ", False), ("1.", None), (".5", None), ("1e5", None)])
def test_anything_else_is_still_parsed(text, expected, monkeypatch):
    import math_verify

    calls = []
    real = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda *a, **k: calls.append(a) or real(*a, **k))
    from megatron_logra.rewards import math as rmath

    rmath._parse_gold.cache_clear()
    got = parses_as_math(text)
    assert calls, f"{text!r} was not given to math-verify"
    if expected is not None:
        assert got is expected


def test_a_file_of_plain_numbers_loads_without_parsing_them(tmp_path, monkeypatch):
    import math_verify

    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rewards import build_task

    path = tmp_path / "numbers.jsonl"
    rows = [{"prompt": f"{i} + {i + 1} =", "answer": str(2 * i + 1)} for i in range(300)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    real = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{path}", "task.num_eval=10"])
    task = build_task(cfg.task)
    assert len(task.sources[0].problems) == 300
    assert calls == []
