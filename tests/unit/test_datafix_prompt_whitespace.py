"""Prompts that differ only in whitespace (leading / trailing blanks, a run of blanks, tabs or newlines inside) are
one prompt: a ``jsonl:`` file holding both is refused naming both lines, and a training row that is a benchmark's
held-out prompt but for whitespace is never trained on — while the text the model sees stays as written."""

from __future__ import annotations

import json
import re

import pytest

from megatron_logra.rewards import TaskConfig, build_task, load_jsonl_problems

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _norm(text: str) -> str:
    """The test's own reading of "the same prompt": no blanks at the ends, every run of whitespace one space."""
    return re.sub(r"\s+", " ", text).strip()


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return str(path)


@pytest.mark.parametrize("variant", [
    "What is 2 + 2?  ",         # trailing blanks
    "\tWhat is 2 + 2?",         # a leading tab
    "What is 2  +\n 2?",        # an internal run with a newline
    " What  is\t2 +  2? \n",    # all at once
])
@pytest.mark.parametrize("same_answer", [True, False])
def test_a_prompt_repeated_but_for_whitespace_is_refused_naming_both_lines(tmp_path, variant, same_answer):
    assert variant != "What is 2 + 2?" and _norm(variant) == "What is 2 + 2?"
    rows = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 3 + 3?", "6"),
            (variant, "4" if same_answer else "5")]
    path = _write(tmp_path / "dup.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_jsonl_problems(path)
    text = str(err.value)
    assert text.startswith(f"{path}:4: the prompt repeats line 2")
    assert "but for whitespace" in text
    assert ("with the same answer" in text) == same_answer
    with pytest.raises(ValueError, match=r":4: the prompt repeats line 2"):  # as a training source too
        build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=0))


def test_prompts_differing_in_other_characters_still_load_as_written(tmp_path):
    rows = [("  What is 2 + 2?\n", "4"), ("What is 2 + 22?", "24"), ("What is 2+2?", "4"), ("what is 2 + 2?", "4")]
    assert len({_norm(p) for p, _ in rows}) == len(rows)  # four distinct prompts
    path = _write(tmp_path / "ok.jsonl", rows)
    problems = load_jsonl_problems(path)
    assert [p.prompt for p in problems] == [p for p, _ in rows]  # the text the model sees is untouched


@pytest.fixture
def spaced(tmp_path):
    """A training file of 40 rows and a benchmark of 8 whose first 5 are training rows spelt with other
    whitespace."""
    train = [(f"what is {i} plus one", str(i + 1)) for i in range(40)]
    respelt = ["  what is 0 plus one", "what is 1  plus one\n", "what\tis 2 plus one", " what is 3 plus  one ",
               "what is\n4 plus one"]
    bench = [(p, _norm(p).split()[2]) for p in respelt] + [(f"what is {i} plus one", "0") for i in (100, 101, 102)]
    return (f"jsonl:{_write(tmp_path / 'train.jsonl', train)}", f"jsonl:{_write(tmp_path / 'bench.jsonl', bench)}",
            train, bench)


def test_training_skips_a_benchmark_prompt_spelt_with_other_whitespace(spaced):
    train_spec, bench_spec, train, bench = spaced
    task = build_task(TaskConfig(datasets=[train_spec], eval_datasets=[bench_spec], num_eval=50))
    held = {_norm(p) for p, _ in bench}
    expected = {p for p, _ in train if _norm(p) not in held}
    assert len(expected) == len(train) - 5
    seen = {task.train_problem(i).prompt for i in range(2000)}
    assert seen == expected
    # the benchmark's prompts are evaluated as its file writes them
    assert [p.prompt for p in task.eval_problems()] == [p for p, _ in bench]
    assert all(task.is_eval_prompt(p) for p, _ in bench)
    assert task.is_eval_prompt("what is 0 plus one") and not task.is_eval_prompt("what is 5 plus one")
