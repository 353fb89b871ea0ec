"""A run stopped before its first checkpoint (killed, preempted or out of time before ``train.save_interval``
steps) leaves ``config.yaml`` and ``metrics.jsonl`` but nothing to continue from. ``train --resume RUN`` is refused
and a new run there too: both name the way on, ``train.overwrite=true`` (with the command that repeats the run's
config). The new-run refusal used to advise ``--resume RUN``, which is refused, and ``--resume`` named no way on."""

from __future__ import annotations

import json
import shutil

import pytest

from support.cli import exit_2, one_process_cli  # noqa: F401
from support.run_fixtures import run_recipe


@pytest.fixture
def stopped(tmp_path):
    """lm-tiny's run directory as a job killed before its first save leaves it."""
    run = tmp_path / "run"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=2", "train.progress=false"])
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    (run / "checkpoints" / "step_00000002.tmp").mkdir(parents=True)  # an unfinished first save
    return run


def test_resume_and_a_new_run_name_the_restart(stopped, capsys):
    restart = f"train.overwrite=true (megatron-logra train {stopped / 'config.yaml'} train.overwrite=true"
    err = exit_2(["train", "--resume", str(stopped)], capsys)
    assert "has no checkpoint" in err and "stopped before its first checkpoint" in err and restart in err, err
    err = exit_2(["train", "lm-tiny", f"train.run_dir={stopped}"], capsys)
    assert "already holds a run (checkpoints/step_00000002.tmp, metrics.jsonl)" in err and restart in err, err
    assert f"--resume {stopped}," not in err and "continue it with" not in err, err


def test_the_named_restart_trains_from_step_0(stopped, capsys):
    from megatron_logra.cli import main

    assert main(["train", str(stopped / "config.yaml"), "train.overwrite=true", "train.progress=false"]) == 0
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    steps = [json.loads(line)["step"] for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_run_with_a_checkpoint_is_still_pointed_at_resume(tmp_path, capsys):
    run = tmp_path / "run"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=2", "train.progress=false"])
    err = exit_2(["train", "lm-tiny", f"train.run_dir={run}"], capsys)
    assert f"continue it with --resume {run}" in err and "stopped before its first checkpoint" not in err, err


def test_the_named_restart_of_a_run_started_by_a_bare_resume_works(tmp_path, capsys):
    """A run started with ``train.resume=true`` (``--load DIR`` on an empty directory) records it in its
    ``config.yaml``; the restart named for it must turn it off, since ``train.resume=true`` with
    ``train.overwrite=true`` is refused. The command is run exactly as the message gives it."""
    import re
    import shlex

    from megatron_logra.cli import main

    run = tmp_path / "run"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=2", "train.progress=false", "train.resume=true"])
    shutil.rmtree(run / "checkpoints")
    (run / "summary.json").unlink()
    err = exit_2(["train", "--resume", str(run)], capsys)
    named = re.search(r"\(megatron-logra (train .*?) repeats its config\)", err)
    assert named and "train.resume=false" in named.group(1), err
    assert main([*shlex.split(named.group(1)), "train.progress=false"]) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
