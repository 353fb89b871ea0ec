"""Held-out benchmarks of their own (``task.eval_datasets``, as slime's ``--eval-prompt-data`` and verl's
``data.val_files``): the held-out set is theirs, each scored and reported on its own, and training uses every other
prompt of ``task.datasets`` — including the ones the ``task.eval_modulus`` split would have held out — while never
a benchmark prompt, so the two stay disjoint by text."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.rewards import TaskConfig, build_task, prompt_bucket
from support.jsonl_rows import write_rows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture
def files(tmp_path):
    """A training file of 64 rows and a benchmark of 12 rows, 6 of which are also training rows."""
    train = [(f"what is {i} plus one", str(i + 1)) for i in range(64)]
    bench = train[:6] + [(f"what is {i} plus one", str(i + 1)) for i in range(100, 106)]
    return write_rows(tmp_path / "train.jsonl", train), write_rows(tmp_path / "bench.jsonl", bench), train, bench


def _train_prompts(task, n: int = 3000) -> set[str]:
    return {task.train_problem(i).prompt for i in range(n)}


def test_the_held_out_set_is_the_benchmark_and_training_skips_exactly_its_prompts(files):
    train_spec, bench_spec, train, bench = files
    task = build_task(TaskConfig(datasets=[train_spec], eval_datasets=[bench_spec], num_eval=50))
    assert [(p.prompt, p.answer, p.source) for p in task.eval_problems()] == [(p, a, bench_spec) for p, a in bench]
    assert task.eval_names == [bench_spec] and task.names == [train_spec]
    seen = _train_prompts(task)
    assert seen == {p for p, _ in train} - {p for p, _ in bench}  # every other training row, the hashed ones too
    assert any(prompt_bucket(p, 16) == 0 for p in seen)  # rows the eval_modulus split would have held out
    # without a benchmark, the same file holds out 1/eval_modulus of its own rows instead
    split = build_task(TaskConfig(datasets=[train_spec], num_eval=50))
    assert all(prompt_bucket(p.prompt, 16) == 0 for p in split.eval_problems())
    assert not any(prompt_bucket(p, 16) == 0 for p in _train_prompts(split))


def test_a_benchmark_problem_is_scored_by_its_own_source(files):
    train_spec, bench_spec, _, bench = files
    task = build_task(TaskConfig(datasets=[train_spec], eval_datasets=[bench_spec]))
    problem = task.eval_problems()[-1]
    assert problem.source == bench_spec
    assert task.score(problem, f"the answer is \\boxed{{{bench[-1][1]}}}")[1] is True
    assert task.score(problem, "\\boxed{7}")[1] is False


def test_num_eval_caps_each_benchmark_and_says_so(files, caplog):
    train_spec, bench_spec, _, bench = files
    with caplog.at_level(logging.WARNING):
        task = build_task(TaskConfig(datasets=[train_spec], eval_datasets=[bench_spec, "chain_sum"], num_eval=4))
        problems = task.eval_problems()
    assert [p.prompt for p in problems if p.source == bench_spec] == [p for p, _ in bench[:4]]
    drawn = [p.prompt for p in problems if p.source == "chain_sum"]
    assert len(drawn) == len(set(drawn)) == 4
    assert "evaluating its first 4 of 12 rows" in caplog.text and "task.num_eval=4" in caplog.text
    # the rows past the cap are not held out: training may use them
    assert bench[4][0] in _train_prompts(task)


def test_a_training_file_that_is_all_benchmark_is_refused(tmp_path):
    rows = [(f"what is {i} plus one", str(i + 1)) for i in range(8)]
    train, bench = write_rows(tmp_path / "a.jsonl", rows), write_rows(tmp_path / "b.jsonl", rows + [("what is 9", "9")])
    with pytest.raises(ValueError, match=r"has no training prompts: all 8 of its prompts are eval-only .*"
                                         r"task\.eval_datasets"):
        build_task(TaskConfig(datasets=[train], eval_datasets=[bench]))


@pytest.mark.parametrize("value,message", [
    (["jsonl:{train}"], r"task\.eval_datasets: 'jsonl:.*train\.jsonl' is also in task\.datasets"),
    (["jsonl:{dot}"], r"is also in task\.datasets"),  # another spelling of the same file
    (["Chain Sum"], r"task\.eval_datasets\[0\]='Chain Sum': expected a reasoning-gym name"),
    (["jsonl:"], r"task\.eval_datasets\[0\]='jsonl:': give a file path"),
    (["gcd", "gcd"], r"task\.eval_datasets lists \['gcd'\] more than once"),
])
def test_bad_eval_datasets_are_refused_naming_the_field(files, tmp_path, value, message):
    train_spec = files[0]
    path = train_spec.removeprefix("jsonl:")
    value = [v.format(train=path, dot=f"{tmp_path}/./train.jsonl") for v in value]
    with pytest.raises(ValueError, match=message):
        TaskConfig(datasets=[train_spec], eval_datasets=value)


def test_a_benchmark_only_dataset_takes_dataset_kwargs_and_a_string_list(files):
    cfg = TaskConfig(datasets=[files[0]], eval_datasets=f"gcd,{files[1]}",
                     dataset_kwargs={"gcd": {"min_value": 1, "max_value": 20}})
    assert cfg.eval_datasets == ["gcd", files[1]]
    with pytest.raises(ValueError, match=r"task\.dataset_kwargs\['lcm'\]: not a reasoning-gym dataset of "
                                         r"task\.datasets .* or task\.eval_datasets"):
        TaskConfig(datasets=[files[0]], eval_datasets=["gcd"], dataset_kwargs={"lcm": {}})


@pytest.fixture(scope="module")
def benchmarked(tmp_path_factory):
    from support.run_fixtures import rl_components

    root = tmp_path_factory.mktemp("benchmarked")
    train = write_rows(root / "train.jsonl", [(f"a {i} a", str(i)) for i in range(64)])
    easy = write_rows(root / "easy.jsonl", [(f"a {i} a", str(i)) for i in range(100, 106)])
    hard = write_rows(root / "hard.jsonl", [(f"a {i} a", str(i)) for i in range(200, 203)])
    with rl_components(root / "run", ["rl.steps=1", "rl.prompts_per_step=4", "rl.group_size=2",
                                      "rl.micro_batch_size=8", f"task.datasets={train}",
                                      f"task.eval_datasets={easy},{hard}", "model.seq_length=32"]) as built:
        yield built


def test_the_held_out_accuracy_is_reported_per_benchmark(benchmarked, monkeypatch):
    from megatron_logra.rl.evaluation import evaluate_held_out

    comps, _ = benchmarked
    seen: list[str] = []

    def score(problem, completion):  # every answer to the easy benchmark is right, every one to the hard one wrong
        seen.append(problem.source)
        return (1.0, True) if problem.source.endswith("easy.jsonl") else (0.0, False)

    monkeypatch.setattr(comps.task, "score", score)
    accuracy, by_source = evaluate_held_out(comps)
    assert sorted(seen) == sorted([comps.task.eval_names[0]] * 6 + [comps.task.eval_names[1]] * 3)
    assert by_source == {"eval_accuracy/jsonl:easy.jsonl": 1.0, "eval_accuracy/jsonl:hard.jsonl": 0.0}
    assert accuracy == pytest.approx(6 / 9)


def test_several_samples_per_problem_report_pass_at_k(benchmarked, monkeypatch):
    """``rl.rollout.eval_samples=3``: ``eval_accuracy`` is the mean over the 3 (avg@3) and ``eval_pass_at_k`` the share
    of problems with a correct one among them."""
    from collections import Counter

    from megatron_logra.rl.evaluation import evaluate_held_out

    comps, _ = benchmarked
    monkeypatch.setattr(comps.cfg.rl.rollout, "eval_samples", 3)
    calls: Counter = Counter()

    def score(problem, completion):  # the second sample of each easy problem is right, every other one wrong
        calls[problem.prompt] += 1
        right = problem.source.endswith("easy.jsonl") and calls[problem.prompt] == 2
        return (1.0, True) if right else (0.0, False)

    monkeypatch.setattr(comps.task, "score", score)
    accuracy, fields = evaluate_held_out(comps)
    assert set(calls.values()) == {3} and len(calls) == 9
    assert accuracy == pytest.approx(6 / 27) and fields["eval_pass_at_k"] == pytest.approx(6 / 9)
    assert fields["eval_accuracy/jsonl:easy.jsonl"] == pytest.approx(1 / 3)
    monkeypatch.setattr(comps.cfg.rl.rollout, "eval_samples", 1)
    assert "eval_pass_at_k" not in evaluate_held_out(comps)[1]


def test_an_unknown_benchmark_name_is_refused_naming_its_field(files):
    with pytest.raises(ValueError, match=r"task\.eval_datasets: 'chain_summ' is not a reasoning-gym dataset\. "
                                         r"Did you mean chain_sum"):
        build_task(TaskConfig(datasets=[files[0]], eval_datasets=["chain_summ"]))
