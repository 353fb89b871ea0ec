"""``task.num_eval=0`` with ``task.eval_datasets``: held-out evaluation is off, as ``task.num_eval=0`` means
everywhere else (accepted; ``eval_accuracy`` null). One warning says so — that the benchmarks are not evaluated and
none of their prompts is kept out of training — instead of "evaluating its first 0 of 10 rows … raise it to
evaluate them all"."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from support.jsonl_rows import write_rows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture
def files(tmp_path):
    """A training file of 30 rows and a benchmark of 10, 4 of which are training rows."""
    train = [(f"how much is {i} and two", str(i + 2)) for i in range(30)]
    bench = train[:4] + [(f"how much is {i} and two", str(i + 2)) for i in range(200, 206)]
    return write_rows(tmp_path / "train.jsonl", train), write_rows(tmp_path / "bench.jsonl", bench), train, bench


def test_num_eval_zero_turns_benchmark_evaluation_off_and_says_so_once(files, caplog):
    train_spec, bench_spec, train, bench = files
    with caplog.at_level(logging.WARNING):
        task = build_task(TaskConfig(datasets=[train_spec], eval_datasets=[bench_spec, "chain_sum"], num_eval=0))
        assert task.eval_problems() == []
        seen = {task.train_problem(i).prompt for i in range(1500)}
    text = caplog.text
    assert "evaluating its first 0" not in text and "raise it to evaluate them all" not in text
    notes = [r.getMessage() for r in caplog.records if "held-out evaluation is off" in r.getMessage()]
    assert len(notes) == 1  # once, not once per benchmark nor per draw
    assert "task.num_eval=0" in notes[0] and bench_spec in notes[0] and "chain_sum" in notes[0]
    assert "task.num_eval=N" in notes[0] and "training" in notes[0]
    # as the warning says: nothing is held out, so the benchmark rows of the training file are trained on
    assert seen == {p for p, _ in train}
    assert sum(p in seen for p, _ in bench) == 4


def test_a_positive_num_eval_still_warns_of_a_benchmark_cut_short(files, caplog):
    train_spec, bench_spec, _, bench = files
    with caplog.at_level(logging.WARNING):
        task = build_task(TaskConfig(datasets=[train_spec], eval_datasets=[bench_spec], num_eval=3))
        problems = task.eval_problems()
    assert [p.prompt for p in problems] == [p for p, _ in bench[:3]]
    assert f"evaluating its first 3 of {len(bench)} rows" in caplog.text
    assert "held-out evaluation is off" not in caplog.text


def test_num_eval_zero_without_benchmarks_gives_no_such_warning(files, caplog):
    with caplog.at_level(logging.WARNING):
        task = build_task(TaskConfig(datasets=[files[0]], num_eval=0))
        assert task.eval_problems() == []
    assert "held-out evaluation is off" not in caplog.text
