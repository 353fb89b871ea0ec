"""A resumed RL run's ``summary.json`` describes the whole run, as the language-model job's does.

``eval_accuracy_before`` is the held-out accuracy before update 1, carried over from the previous
``summary.json`` (not re-measured at the resume point), the unprefixed times add up every process of
the run, and ``resumed_from_step`` / ``segment_*`` describe the last process alone. One real run of
the tiny recipe (1 update, small batches) is resumed to 2 updates; the rest reads summaries only.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest

from support.run_fixtures import run_rl_recipe

SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "task.num_eval=8", "rl.eval_interval=0",
         "train.progress=false"]
SEGMENT = ("resumed_from_step", "segment_steps", "segment_eval_accuracy_before", "segment_setup_seconds",
           "segment_rl_seconds", "segment_total_seconds")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _run(run: Path, steps: int, *extra: str) -> dict:
    """``train tiny`` into ``run`` with ``rl.steps=steps`` (a resume with ``train.resume=true``)."""
    return run_rl_recipe("tiny", [f"train.run_dir={run}", f"rl.steps={steps}", *SMALL, *extra])


def _resume(run: Path, steps: int) -> dict:
    return _run(run, steps, "train.resume=true")


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Path:
    """A 1-update run of the tiny recipe, checkpointed at step 1."""
    run = tmp_path_factory.mktemp("rl_summary") / "run"
    summary = _run(run, 1)
    assert summary["steps"] == 1
    return run


def _copy(first: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(first, run)
    return run


def test_a_new_run_is_its_own_only_segment(first):
    s = json.loads((first / "summary.json").read_text())
    assert s["resumed_from_step"] == 0 and s["segment_steps"] == s["steps"] == 1
    assert s["segment_eval_accuracy_before"] == s["eval_accuracy_before"] is not None
    for key in ("setup_seconds", "rl_seconds", "total_seconds"):
        assert s[f"segment_{key}"] == s[key] > 0


def test_resumed_summary_covers_the_whole_run(first, tmp_path, caplog):
    """The previous summary's accuracy before update 1 is carried (a marker value no evaluation of 8
    problems can give, so a re-measured one would show), its times are added to this process's."""
    run = _copy(first, tmp_path)
    previous = json.loads((run / "summary.json").read_text())
    previous["eval_accuracy_before"] = 0.0625 + 1 / 1024  # not k/8
    (run / "summary.json").write_text(json.dumps(previous))

    with caplog.at_level(logging.INFO, logger="megatron_logra.rl.job"):
        s = _resume(run, 2)
    # the accuracy measured at the resume point is not called the one before RL
    assert "held-out accuracy at RL step 1 (resumed)" in caplog.text
    assert "held-out accuracy before RL" not in caplog.text
    assert json.loads((run / "summary.json").read_text()) == s
    assert s["steps"] == 2 and s["resumed_from_step"] == 1 and s["segment_steps"] == 1
    assert s["eval_accuracy_before"] == previous["eval_accuracy_before"]
    assert s["segment_eval_accuracy_before"] * 8 == round(s["segment_eval_accuracy_before"] * 8)  # measured now
    assert s["eval_accuracy_after"] is not None and s["stopped"] is None
    for key in ("setup_seconds", "rl_seconds", "total_seconds"):
        assert s[f"segment_{key}"] > 0
        assert s[key] == previous[key] + s[f"segment_{key}"]

    # resumed again with nothing to train: the same whole run, an empty segment
    again = _resume(run, 2)
    assert again["steps"] == 2 and again["resumed_from_step"] == 2 and again["segment_steps"] == 0
    assert again["eval_accuracy_before"] == previous["eval_accuracy_before"]
    assert again["eval_accuracy_after"] == again["segment_eval_accuracy_before"] == s["eval_accuracy_after"]
    assert again["rl_seconds"] == s["rl_seconds"] + again["segment_rl_seconds"]


def test_resume_without_the_previous_summary_leaves_whole_run_values_unknown(first, tmp_path):
    """Every earlier process killed before writing its summary (and, here, the accuracy before update 1 lost
    too): what they measured is unknown (null), never this process's numbers passed off as the run's."""
    run = _copy(first, tmp_path)
    (run / "summary.json").unlink()
    (run / "eval_before.json").unlink()
    s = _resume(run, 2)
    assert s["steps"] == 2 and s["resumed_from_step"] == 1
    assert s["eval_accuracy_before"] is None and s["segment_eval_accuracy_before"] is not None
    assert s["setup_seconds"] is None and s["rl_seconds"] is None and s["total_seconds"] is None
    assert set(SEGMENT) <= set(s)
    assert json.loads((run / "summary.json").read_text())["eval_accuracy_before"] is None


@pytest.mark.parametrize("previous, start, expected", [
    # a whole-run summary ending at the resume step: everything carries
    ({"steps": 3, "resumed_from_step": 1, "eval_accuracy_before": 0.25, "setup_seconds": 1.0, "rl_seconds": 2.0,
      "total_seconds": 4.0}, 3,
     {"eval_accuracy_before": 0.25, "setup_seconds": 1.0, "rl_seconds": 2.0, "total_seconds": 4.0}),
    # it ended at a later step (latest rolled back by hand) or earlier (a later process was killed): times
    # do not add up to the resume step, the accuracy before update 1 still holds
    ({"steps": 5, "resumed_from_step": 0, "eval_accuracy_before": 0.25, "rl_seconds": 2.0}, 3,
     {"eval_accuracy_before": 0.25}),
    ({"steps": 2, "resumed_from_step": 0, "eval_accuracy_before": 0.25, "rl_seconds": 2.0}, 3,
     {"eval_accuracy_before": 0.25}),
    # a one-process summary (no resumed_from_step): only one that ends at the resume step
    ({"steps": 3, "eval_accuracy_before": 0.5, "rl_seconds": 2.0}, 3, {"eval_accuracy_before": 0.5, "rl_seconds": 2.0}),
    ({"steps": 2, "eval_accuracy_before": 0.5, "rl_seconds": 2.0}, 3, {}),
    # unmeasured (task.num_eval=0) or not a number: absent
    ({"steps": 3, "resumed_from_step": 0, "eval_accuracy_before": None, "rl_seconds": True}, 3, {}),
    ([1, 2], 3, {}),
])
def test_previous_summary_reads_what_the_earlier_processes_did(tmp_path, previous, start, expected):
    from megatron_logra.rl.progress import previous_summary

    path = tmp_path / "summary.json"
    path.write_text(json.dumps(previous))
    assert previous_summary(path, start) == expected
    path.write_text('{"steps": 3, "eval_accuracy_bef')  # torn
    assert previous_summary(path, 3) == {}
    assert previous_summary(tmp_path / "missing.json", 3) == {}


def test_eval_reports_the_checkpoint_it_evaluates_and_changes_nothing(first, capsys, caplog):
    from megatron_logra.cli import main
    from megatron_logra.parallel import destroy_parallel

    before = {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()}
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="megatron_logra.rl"):
        warnings.simplefilter("ignore")
        try:
            assert main(["eval", str(first)]) == 0
        finally:
            destroy_parallel()
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 1 and out["num_eval"] == 8 and 0 <= out["eval_accuracy"] <= 1
    assert "evaluating " in caplog.text and "resumed from" not in caplog.text  # eval resumes nothing
    assert {p: p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()} == before
