"""JSONL problem files: gold answers math-verify cannot parse are found when the task is built, and a ``jsonl:``
path may hold commas.

* A row whose gold answer math-verify cannot parse is dropped at load with one warning naming the file, the count
  and the lines (it used to warn at every completion scored against it); a file of only such rows is refused.
* ``task.datasets=jsonl:/dir/a,b.jsonl`` names the file ``a,b.jsonl`` (it used to be split into two specs).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from megatron_logra.rewards.math import math_equal


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]


def test_unparsable_gold_answers_are_dropped_at_load_with_one_warning(tmp_path, caplog):
    rows = _rows(40)
    rows[3]["answer"], rows[17]["answer"] = "}", "$$"  # lines 4 and 18: math-verify finds nothing in them
    path = _write(tmp_path / "set.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards"):
        task = build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=2, eval_modulus=2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and "skipping 2 of 40 rows" in warnings[0]
    assert "line 4: '}'" in warnings[0] and "line 18: '$$'" in warnings[0]
    source = task.sources[0]
    assert source.size == 38 and len(source.problems) == 38
    assert {p.answer for p in source.problems}.isdisjoint({"}", "$$"})
    assert all(p.metadata["line"] not in (4, 18) for p in source.problems)


def test_a_file_of_only_unparsable_answers_is_refused_naming_file_and_lines(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a?", "answer": "}"}, {"prompt": "b?", "answer": "$$"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: math-verify cannot parse the gold answer of any of its 2 rows "
                                         r"\(line 1: '}'; line 2: '\$\$'\)"):
        build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=0))


def test_a_reward_plugin_keeps_every_row(tmp_path):
    """Another scorer may read answers math-verify cannot: nothing is dropped."""
    rows = _rows(40)
    rows[0]["answer"] = "}"
    path = _write(tmp_path / "set.jsonl", rows)
    task = build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=0, reward="operator:eq"))  # (problem, completion)
    assert task.sources[0].size == 40


def test_scoring_against_an_unparsable_gold_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.math"):
        for _ in range(3):
            assert not math_equal("\\boxed{}", "2")
    assert sum("could not parse the reference answer" in r.getMessage() for r in caplog.records) == 1


def test_jsonl_path_with_a_comma(tmp_path):
    path = _write(tmp_path / "a,b.jsonl", _rows(40))
    cfg = TaskConfig(datasets=f"jsonl:{path},gcd")  # the string form, as on the command line
    assert cfg.datasets == [f"jsonl:{path}", "gcd"]
    task = build_task(TaskConfig(datasets=f"jsonl:{path}", num_eval=0))
    assert task.sources[0].size == 40
    # through the command-line override, which splits a list at its commas
    from megatron_logra.config import parse_args_to_config

    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{path}"])
    assert cfg.task.datasets == [f"jsonl:{path}"]


def test_comma_between_two_existing_specs_still_splits(tmp_path):
    one, two = _write(tmp_path / "one.jsonl", _rows(4)), _write(tmp_path / "two.jsonl", _rows(4))
    assert TaskConfig(datasets=f"jsonl:{one},jsonl:{two}").datasets == [f"jsonl:{one}", f"jsonl:{two}"]
    assert TaskConfig(datasets=f"jsonl:{one},chain_sum").datasets == [f"jsonl:{one}", "chain_sum"]
    # a file named like "x,chain_sum" that exists, where "x" does not: the path
    odd = _write(tmp_path / "x,chain_sum", _rows(4))
    assert TaskConfig(datasets=f"jsonl:{odd}").datasets == [f"jsonl:{odd}"]
