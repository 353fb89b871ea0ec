"""The held-out accuracy before training is kept per source, as the accuracy after it is: ``summary.json`` and
``eval_before.json`` hold ``eval_accuracy_before/SOURCE`` for a task mixture, a resumed run carries them over
(from the previous summary, or from ``eval_before.json`` when the earlier process left none), and ``plot`` starts
each source's curve there. Checked against the step-0 held-out answers in ``samples.jsonl``, counted here."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from megatron_logra.plot import held_out_before, read_metrics
from support.run_fixtures import run_recipe

SOURCES = ("chain_sum", "basic_arithmetic")
COMMON = ["task.datasets=chain_sum,basic_arithmetic", "task.weights=1,1", "model.seq_length=96", "task.num_eval=12",
          "rl.log_samples=64", "rl.prompts_per_step=4", "rl.group_size=4", "train.progress=false",
          "train.save_interval=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    run = tmp_path_factory.mktemp("before") / "run"
    run_recipe("tiny", [f"train.run_dir={run}", "rl.steps=1", *COMMON])
    return run


def _read(path):
    return json.loads(path.read_text())


def _counted_before(run) -> dict[str, float]:
    """Each source's share of correct held-out answers at step 0, from samples.jsonl."""
    correct, total = defaultdict(int), defaultdict(int)
    for line in (run / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "eval" and row["step"] == 0:
            correct[row["source"]] += bool(row["correct"])
            total[row["source"]] += 1
    assert set(total) == set(SOURCES) and sum(total.values()) == 12, dict(total)
    return {s: correct[s] / total[s] for s in total}


def test_the_summary_and_eval_before_hold_each_sources_value(run):
    counted = _counted_before(run)
    summary, before = _read(run / "summary.json"), _read(run / "eval_before.json")
    for source, value in counted.items():
        assert summary[f"eval_accuracy_before/{source}"] == pytest.approx(value)
        assert before[f"eval_accuracy_before/{source}"] == pytest.approx(value)
    assert summary["eval_accuracy_before"] == pytest.approx(
        sum(counted[s] * n for s, n in _counts(run).items()) / 12)


def _counts(run) -> dict[str, int]:
    n = defaultdict(int)
    for line in (run / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "eval" and row["step"] == 0:
            n[row["source"]] += 1
    return n


def test_plot_starts_each_sources_curve_before_training(run):
    record = held_out_before(run, read_metrics(run))
    counted = _counted_before(run)
    assert record["step"] == 0
    assert {k: v for k, v in record.items() if k.startswith("eval_accuracy/")} == \
        pytest.approx({f"eval_accuracy/{s}": v for s, v in counted.items()})


@pytest.mark.parametrize("summary_lost", [False, True])
def test_a_resumed_run_carries_the_values_over(run, tmp_path, summary_lost):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    first = _read(copy / "summary.json")
    if summary_lost:  # the first process was killed before writing its summary
        (copy / "summary.json").unlink()
    run_recipe("tiny", [f"train.run_dir={copy}", "train.resume=true", "rl.steps=2", *COMMON])
    resumed = _read(copy / "summary.json")
    assert resumed["resumed_from_step"] == 1
    for source in SOURCES:
        key = f"eval_accuracy_before/{source}"
        assert resumed[key] == first[key]
