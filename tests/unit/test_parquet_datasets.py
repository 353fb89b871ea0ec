"""``parquet:PATH`` datasets (verl's prepared format: a one-user-message ``prompt``, ``reward_model.ground_truth``,
``data_source`` and ``extra_info`` columns): each row is read as the same object in a ``jsonl:`` file would be, so
the task built from the Parquet file holds the problems of the task built from its JSON-lines twin."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_logra.rewards import TaskConfig, build_task, load_jsonl_problems

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _verl_rows(n: int) -> list[dict]:
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"Add {i} and {i + 1}. Put the answer in \\boxed{{}}."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


@pytest.fixture
def twins(tmp_path):
    rows = _verl_rows(48)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return parquet, jsonl


def _view(problems):
    return [(p.prompt, p.answer, p.metadata["line"], p.metadata["data_source"], p.metadata["extra_info"])
            for p in problems]


def test_a_parquet_file_reads_as_its_jsonl_twin(twins):
    parquet, jsonl = twins
    from_parquet = load_jsonl_problems(parquet, f"parquet:{parquet}")
    assert _view(from_parquet) == _view(load_jsonl_problems(jsonl))
    assert from_parquet[3].answer == "7" and from_parquet[3].source == f"parquet:{parquet}"


def test_the_task_of_a_parquet_file_trains_and_holds_out_what_its_twin_does(twins):
    parquet, jsonl = twins
    a = build_task(TaskConfig(datasets=[f"parquet:{parquet}"], num_eval=48))
    b = build_task(TaskConfig(datasets=[f"jsonl:{jsonl}"], num_eval=48))
    held_out = {p.prompt for p in a.eval_problems()}  # the order of draws follows the source's name; the split not
    assert held_out == {p.prompt for p in b.eval_problems()} and held_out
    trained = {a.train_problem(i).prompt for i in range(2000)}
    assert trained == {b.train_problem(i).prompt for i in range(2000)} and not trained & held_out
    problem = a.train_problem(0)
    assert a.score(problem, f"so \\boxed{{{problem.answer}}}")[1] is True


def test_a_parquet_benchmark(twins, tmp_path):
    parquet, jsonl = twins
    bench = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(60)[50:]), bench)
    task = build_task(TaskConfig(datasets=[f"jsonl:{jsonl}"], eval_datasets=[f"parquet:{bench}"]))
    assert len(task.eval_problems()) == 10 and task.eval_names == [f"parquet:{bench}"]
    with pytest.raises(ValueError, match=r"task\.eval_datasets: 'parquet:.*train\.parquet' is also in task\.datasets"):
        TaskConfig(datasets=[f"parquet:{parquet}"], eval_datasets=[f"parquet:{parquet}"])


def test_a_file_that_is_not_parquet_is_refused_naming_it(twins):
    _, jsonl = twins
    with pytest.raises(ValueError, match=rf"{jsonl}: not a readable Parquet file"):
        build_task(TaskConfig(datasets=[f"parquet:{jsonl}"]))


def test_without_pyarrow_the_error_names_the_install_and_the_jsonl_way(twins, monkeypatch):
    parquet, _ = twins
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import pyarrow.parquet raises ImportError
    with pytest.raises(ValueError, match=r"needs pyarrow \(pip install pyarrow\), or convert the file to JSON lines"):
        build_task(TaskConfig(datasets=[f"parquet:{parquet}"]))


def test_parquet_specs_are_checked_and_named_by_file_in_metrics():
    from megatron_logra.rl.source_metrics import field_names

    with pytest.raises(ValueError, match=r"task\.datasets\[0\]='parquet:': give a file path after 'parquet:'"):
        TaskConfig(datasets=["parquet:"])
    assert field_names(["parquet:/data/gsm8k/test.parquet", "gcd"]) == ["parquet:test.parquet", "gcd"]


def test_a_home_relative_path_is_expanded(twins, monkeypatch):
    parquet, _ = twins
    monkeypatch.setenv("HOME", str(parquet.parent))
    task = build_task(TaskConfig(datasets=["parquet:~/train.parquet"]))
    assert task.sources[0].path == parquet and len(task.sources[0].problems) == 48
