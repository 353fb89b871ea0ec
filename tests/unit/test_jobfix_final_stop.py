"""``train.exit_signal_handler=true`` after the last step: a SIGTERM that arrives during the final save or
the final held-out evaluation must not kill the job. The last step's checkpoint is saved before that
evaluation with the handler still installed, so the job ends normally (exit status 0) with its final
checkpoint and ``summary["stopped"] == "SIGTERM"``.

The signal is sent by the job process to itself from a wrapper around the real ``evaluate`` /
``save_checkpoint`` (at a chosen call), so it lands at a known point; everything else is the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import forked

from megatron_logra.checkpoint import latest_checkpoint, read_meta

ROOT = Path(__file__).resolve().parents[2]

_DRIVER = """
import os, signal, sys
import {module} as job
real = job.{name}
calls = []
def wrapped(*args, **kwargs):
    calls.append(None)
    if len(calls) == {at}:  # this call is the one after the last step
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
job.{name} = wrapped
from megatron_logra.cli import main
sys.exit(main(sys.argv[1:]))
"""

LM_SMALL = ["train.progress=false", "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=0",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]
RL_SMALL = ["train.progress=false", "rl.prompts_per_step=2", "rl.group_size=4", "rl.eval_interval=0",
            "task.num_eval=4", "train.save_interval=0"]


def _run(module: str, name: str, at: int, argv: list[str]) -> subprocess.CompletedProcess:
    """``python -c DRIVER argv...`` in a process of its own, forked warm (:mod:`support.forked`) where it can be."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    code = _DRIVER.format(module=module, name=name, at=at)
    if forked.usable():
        return forked.run_python(["-c", code, *argv], env=env, cwd=ROOT, timeout=300)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    out = proc.stdout
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


@pytest.mark.parametrize("name, at, evaluated", [
    ("evaluate", 2, True),         # calls: before training, then the final evaluation
    ("save_checkpoint", 1, False),  # save_interval=0: the only save is the last step's
])
def test_sigterm_during_the_lm_jobs_final_save_or_evaluation_ends_it_normally_with_its_checkpoint(
        tmp_path, name, at, evaluated):
    run = tmp_path / "run"
    proc = _run("megatron_logra.train.lm", name, at,
                ["train", "lm-tiny", f"train.run_dir={run}", "train.steps=3", "train.exit_signal_handler=true",
                 *LM_SMALL])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    summary = _summary(proc)
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 3
    # a signal during the save skips the evaluation; one during the evaluation lets it finish
    assert (summary["eval_loss_after"] is not None) == evaluated
    assert read_meta(latest_checkpoint(run))["step"] == 3
    assert json.loads((run / "summary.json").read_text()) == summary


def test_sigterm_during_the_rl_jobs_final_evaluation_ends_it_normally_with_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _run("megatron_logra.rl.job", "evaluate_held_out", 2,  # before RL, then the final evaluation
                ["train", "tiny", f"train.run_dir={run}", "rl.steps=2", "train.exit_signal_handler=true", *RL_SMALL])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    summary = _summary(proc)
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 2
    assert summary["eval_accuracy_after"] is not None  # the evaluation under way finished
    assert read_meta(latest_checkpoint(run))["step"] == 2
    assert json.loads((run / "summary.json").read_text())["stopped"] == "SIGTERM"


_GROUP_DRIVER = """
import os, signal, sys
import megatron_logra.train.lm as job
real_save, real_fb = job.save_checkpoint, job.forward_backward
state = {"saved": False, "sent": False}
def save(*args, **kwargs):
    out = real_save(*args, **kwargs)
    state["saved"] = True
    return out
def forward_backward(*args, **kwargs):
    if state["saved"] and not state["sent"]:  # the step after the first save: signal the whole job
        state["sent"] = True
        os.killpg(os.getpgid(0), signal.SIGTERM)
    return real_fb(*args, **kwargs)
job.save_checkpoint, job.forward_backward = save, forward_backward
from megatron_logra.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_to_the_whole_process_group_saves_the_step_in_flight(tmp_path):
    """Slurm signals every process of a job step: megatron-core's checkpoint-writer helper (a spawned
    process started at the first save) must survive it, or the stop's save fails with a broken pipe."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _GROUP_DRIVER, "train", "lm-tiny", f"train.run_dir={run}",
                           "train.steps=4", "train.exit_signal_handler=true", *LM_SMALL, "train.save_interval=2"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
                          start_new_session=True)  # its own process group: the signal stays inside it
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    summary = _summary(proc)
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 3
    assert read_meta(latest_checkpoint(run))["step"] == 3
