"""JSONL problem files: numbers reach math-verify as the numbers they are, and bad files (not UTF-8,
non-finite answers, repeated ids or prompts, null ids, only eval-only prompts) are refused with
``PATH:LINE`` errors at load / build time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.rewards import MathVerifyScorer, TaskConfig, build_task, load_jsonl_problems, math_equal, prompt_bucket


def _write(path: Path, *rows: dict | str) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows),
                    encoding="utf-8")
    return path


# ------------------------------------------------------------------ item 1: numbers, never exponent notation
@pytest.mark.parametrize("literal, text, right, wrong", [
    ("1e-7", "0.0000001", ["0.0000001", "10^{-7}", "\\boxed{10^{-7}}"], ["e-7", "-7"]),
    ("0.00001234", "0.00001234", ["0.00001234", "1.234 \\times 10^{-5}"], ["e-5", "1.234"]),
    ("1e20", "100000000000000000000", ["100000000000000000000", "10^{20}"], ["e+20", "20"]),
    ("2.5E3", "2500.0", ["2500", "2,500"], ["2.5", "e+3"]),
    ("0.5", "0.5", ["\\frac{1}{2}", "0.5"], ["5"]),
    ("-3", "-3", ["-3"], ["3"]),
])
def test_a_number_answer_is_scored_by_math_verify_as_that_number(tmp_path, literal, text, right, wrong):
    path = tmp_path / "num.jsonl"
    path.write_text('{"prompt": "q", "answer": ' + literal + '}\n', encoding="utf-8")
    (problem,) = load_jsonl_problems(path)
    assert problem.answer == text and "e" not in problem.answer.lower()
    scorer = MathVerifyScorer()
    for completion in right:
        assert math_equal(problem.answer, completion), completion
        assert scorer.score(problem, f"The answer is $\\boxed{{{completion}}}$") == 1.0, completion
    for completion in wrong:
        assert not math_equal(problem.answer, completion), completion


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_number_answer_is_refused_naming_the_line(tmp_path, literal):
    path = tmp_path / "inf.jsonl"
    path.write_text('{"prompt": "ok", "answer": 1}\n{"prompt": "q", "answer": ' + literal + '}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{path}:2: 'answer' must be a finite number"):
        load_jsonl_problems(path)


# ------------------------------------------------------------------ item 2: encoding
def test_bytes_that_are_not_utf8_are_refused_naming_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:3: not UTF-8 .*byte 0xe9.*re-save the file as UTF-8"):
        load_jsonl_problems(path)


def test_a_utf8_byte_order_mark_and_crlf_line_ends_are_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "café?", "answer": "1"}\r\n{"prompt": "b", "answer": 2}\r\n'.encode())
    problems = load_jsonl_problems(path)
    assert [(p.prompt, p.answer, p.metadata["line"]) for p in problems] == [("café?", "1", 1), ("b", "2", 2)]


# ------------------------------------------------------------------ item 4: ids and repeated prompts
@pytest.mark.parametrize("rows, line, message", [
    ([{"prompt": "a", "answer": 2, "id": 1}, {"prompt": "b", "answer": 3, "id": 1}], 2, "id '1' repeats line 1"),
    ([{"prompt": "a", "answer": 2, "id": "x"}, {"prompt": "b", "answer": 3, "unique_id": "x"}], 2,
     "id 'x' repeats line 1"),
    ([{"prompt": "a", "answer": 2}, {"prompt": "b", "answer": 1}, {"prompt": "a", "answer": 3}], 3,
     r"the prompt repeats line 1 with another answer \('2' there, '3' here\)"),
    ([{"prompt": "a", "answer": 2}, {"problem": "a", "solution": "so \\boxed{2}"}], 2,
     "the prompt repeats line 1 with the same answer"),
    ([{"prompt": "a", "answer": 2, "id": None}], 1, "'id' must be a non-empty string or an integer, got None"),
    ([{"prompt": "a", "answer": 2, "unique_id": ""}], 1, "'unique_id' must be a non-empty string"),
    ([{"prompt": "a", "answer": 2, "id": [1]}], 1, "'id' must be a non-empty string or an integer"),
    ([{"prompt": "a", "answer": 2, "id": True}], 1, "'id' must be a non-empty string or an integer"),
])
def test_repeated_ids_and_prompts_and_bad_ids_are_refused_naming_both_lines(tmp_path, rows, line, message):
    path = _write(tmp_path / "dup.jsonl", *rows)
    with pytest.raises(ValueError, match=rf"^{path}:{line}: {message}"):
        load_jsonl_problems(path)


def test_distinct_ids_and_prompts_load(tmp_path):
    path = _write(tmp_path / "ok.jsonl", {"prompt": "a", "answer": 2, "id": 0}, {"prompt": "b", "answer": 2, "id": "0x"},
                  {"prompt": "c", "answer": 2})
    assert [p.metadata["id"] for p in load_jsonl_problems(path)] == ["0", "0x", f"jsonl:{path}:3"]


# ------------------------------------------------------------------ item 7: no training rows
def _prompts(eval_only: bool, count: int, modulus: int = 16) -> list[str]:
    out = [f"What is {i}+1?" for i in range(10_000) if (prompt_bucket(f"What is {i}+1?", modulus) == 0) == eval_only]
    return out[:count]


@pytest.mark.parametrize("num_eval", [0, 5])
def test_a_jsonl_file_whose_prompts_are_all_eval_only_is_refused_at_build_time(tmp_path, num_eval):
    path = _write(tmp_path / "small.jsonl", *({"prompt": p, "answer": "1"} for p in _prompts(True, 3)))
    with pytest.raises(ValueError) as err:
        build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=num_eval))
    msg = str(err.value)
    assert msg.startswith(f"{path}: all 3 prompt(s)") and "no training rows" in msg
    assert "task.eval_modulus" in msg and "task.num_eval" in msg and "dataset_kwargs" not in msg


def test_a_jsonl_file_with_one_training_row_trains_on_it(tmp_path):
    train = _prompts(False, 1)[0]
    rows = [{"prompt": p, "answer": "1"} for p in _prompts(True, 3)] + [{"prompt": train, "answer": "2"}]
    task = build_task(TaskConfig(datasets=[f"jsonl:{_write(tmp_path / 'one.jsonl', *rows)}"], num_eval=3))
    assert {task.train_problem(i).prompt for i in range(20)} == {train}
    assert train not in {p.prompt for p in task.eval_problems()}
