"""The held-out score before training survives a run killed before it writes ``summary.json``.

The run that starts at step 0 writes ``RUN/eval_before.json`` as soon as it has measured the score, and a
resumed run's whole-run summary reports it (``run_summary.previous_summary_values`` falls back to it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.run_summary import BEFORE_FILE, previous_summary_values, record_before_values
from support.run_fixtures import run_rl_recipe

SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "task.num_eval=8", "rl.eval_interval=0",
         "train.progress=false"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def test_before_values_are_carried_without_a_summary(tmp_path):
    record_before_values(tmp_path, {"eval_accuracy_before": 0.375, "eval_loss_before": None})
    saved = json.loads((tmp_path / BEFORE_FILE).read_text())
    assert saved == {"eval_accuracy_before": 0.375, "eval_loss_before": None}
    assert not list(tmp_path.glob("*.tmp"))  # replaced atomically, no temp file left
    summary = tmp_path / "summary.json"
    # no summary.json: the value measured before step 1 still carries, the totals do not
    assert previous_summary_values(summary, 3, ("eval_accuracy_before",), ("rl_seconds",)) == \
        {"eval_accuracy_before": 0.375}
    assert previous_summary_values(summary, 3, ("eval_loss_before",)) == {}  # null: not measured
    # a summary that ends here gives its own values (the same run's)
    summary.write_text(json.dumps({"steps": 3, "resumed_from_step": 0, "eval_accuracy_before": 0.5,
                                   "rl_seconds": 2.0}))
    assert previous_summary_values(summary, 3, ("eval_accuracy_before",), ("rl_seconds",)) == \
        {"eval_accuracy_before": 0.5, "rl_seconds": 2.0}
    # a torn summary: the file's value again
    summary.write_text('{"steps": 3, "eval_acc')
    assert previous_summary_values(summary, 3, ("eval_accuracy_before",)) == {"eval_accuracy_before": 0.375}


def test_torn_before_file_gives_nothing(tmp_path):
    (tmp_path / BEFORE_FILE).write_text('{"eval_accuracy_bef')
    assert previous_summary_values(tmp_path / "summary.json", 2, ("eval_accuracy_before",)) == {}


def _run(run: Path, steps: int, *extra: str) -> dict:
    return run_rl_recipe("tiny", [f"train.run_dir={run}", f"rl.steps={steps}", *SMALL, *extra])


def test_rl_run_killed_before_its_summary_keeps_eval_accuracy_before(tmp_path):
    """A 1-update run; its summary.json removed as if the process had been killed before writing it; the run
    resumed to 2 updates reports the accuracy the first process measured before update 1."""
    run = tmp_path / "run"
    first = _run(run, 1)
    before = first["eval_accuracy_before"]
    assert before is not None
    assert json.loads((run / BEFORE_FILE).read_text()) == {"eval_accuracy_before": before}
    (run / "summary.json").unlink()
    resumed = _run(run, 2, "train.resume=true")
    assert resumed["resumed_from_step"] == 1 and resumed["steps"] == 2
    assert resumed["eval_accuracy_before"] == before
    assert resumed["rl_seconds"] is None  # the killed process's times stay unknown
    assert json.loads((run / "summary.json").read_text())["eval_accuracy_before"] == before
    # a new run in the directory (train.overwrite=true) does not inherit the old run's value
    from megatron_logra.checkpoint.run_dir import claim_run_dir

    claim_run_dir(run, resume=False, overwrite=True, lock=False)
    assert not (run / BEFORE_FILE).exists()
