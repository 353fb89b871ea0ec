"""Stopping a run early: the stop conditions themselves (signal handler, wall-time budget) and the LM
and RL jobs stopped by them, which must save the checkpoint of their last step, end normally and
continue from it with ``--resume``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from support import forked

from megatron_logra.train.stopping import STOP_SIGNAL, EarlyStop

LM_SMALL = ["train.progress=false", "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=0",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


def test_without_a_condition_nothing_stops_and_the_handler_is_untouched():
    before = signal.getsignal(STOP_SIGNAL)
    with EarlyStop(signal_handler=False, duration_minutes=0) as stop:
        assert not stop.enabled and stop.check() is None
        assert signal.getsignal(STOP_SIGNAL) is before


def test_the_signal_and_its_prompt_repeats_are_one_notice_then_the_previous_handler_comes_back():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(STOP_SIGNAL, previous)
    try:
        with EarlyStop(signal_handler=True, duration_minutes=0) as stop:
            assert stop.check() is None
            os.kill(os.getpid(), STOP_SIGNAL)
            assert stop.received and stop.check() == "SIGTERM"
            os.kill(os.getpid(), STOP_SIGNAL)  # torchrun's forwarded copy of the same notice: still alive
            assert stop.received and stop.check() == "SIGTERM"
        assert signal.getsignal(STOP_SIGNAL) is previous and seen == []
    finally:
        signal.signal(STOP_SIGNAL, old)


def test_a_repeat_after_the_same_notice_window_ends_the_process():
    code = ("import os, signal, time\n"
            "import megatron_logra.train.stopping as st\n"
            "st.SAME_NOTICE_SECONDS = 0.2\n"
            "with st.EarlyStop(signal_handler=True, duration_minutes=0) as stop:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    assert stop.received\n"
            "    time.sleep(0.5)\n"
            "    print('alive', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(5)\n"
            "print('survived', flush=True)\n")
    proc = forked.python(["-c", code], env=_env(), timeout=120)  # its own process (forked warm where it can be)
    assert proc.returncode == -signal.SIGTERM and proc.stdout.split() == ["alive"], (proc.returncode, proc.stdout,
                                                                                   proc.stderr[-2000:])


def test_the_wall_time_budget_counts_from_the_given_start():
    now = time.monotonic()
    assert EarlyStop(signal_handler=False, duration_minutes=10, start=now - 120).check() is None
    assert EarlyStop(signal_handler=False, duration_minutes=1.5, start=now - 120).check() == "exit_duration_minutes=1.5"
    with pytest.raises(ValueError, match="duration_minutes=-1"):
        EarlyStop(signal_handler=False, duration_minutes=-1)


def _env() -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    return env


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_sigterm_stops_the_lm_job_after_a_step_with_its_checkpoint_and_resume_continues(tmp_path, capsys, one_thread):
    """``train.exit_signal_handler=true``: SIGTERM mid-run ends the job with exit status 0 after the
    step in flight, whose checkpoint is the latest; ``--resume`` continues from it."""
    from megatron_logra.checkpoint import latest_checkpoint, read_meta
    from megatron_logra.cli import main

    run = tmp_path / "run"
    argv = ["-m", "megatron_logra.cli", "train", "lm-tiny", f"train.run_dir={run}", "train.steps=100000",
            "train.exit_signal_handler=true", *LM_SMALL]
    if forked.usable():  # its own process, forked warm: none of a cold interpreter's imports
        proc = forked.Python(argv, env=_env())
    else:
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env())
    try:
        deadline = time.monotonic() + 240
        while len(_records(run)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job wrote no metrics"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("{"):out.rindex("}") + 1])
    last = _records(run)[-1]["step"]
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == last >= 2 and summary["eval_loss_after"] is None
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and read_meta(ckpt)["step"] == last
    assert "stopping after step" in err

    assert main(["train", "--resume", str(run), f"train.steps={last + 2}"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["steps"], summary["segment_steps"], summary["stopped"]) == (last + 2, 2, None)
    assert [r["step"] for r in _records(run)][-3:] == [last, last + 1, last + 2]


def test_a_wall_time_budget_stops_the_rl_job_after_its_first_step(tmp_path, one_thread):
    from megatron_logra.checkpoint import latest_checkpoint, read_meta
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl

    run = tmp_path / "run"
    cfg = parse_args_to_config("tiny", [f"train.run_dir={run}", "train.progress=false", "rl.steps=5",
                                        "rl.prompts_per_step=2", "rl.group_size=4", "rl.eval_interval=0",
                                        "task.num_eval=4", "train.exit_duration_minutes=0.0001"])
    destroy_parallel()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            summary = run_rl(cfg)
    finally:
        destroy_parallel()
    assert summary["stopped"] == "exit_duration_minutes=0.0001"
    assert summary["steps"] == 1 and summary["eval_accuracy_after"] is None
    assert [r["step"] for r in _records(run)] == [1]
    assert read_meta(latest_checkpoint(run))["step"] == 1
    assert json.loads((run / "summary.json").read_text())["stopped"] == summary["stopped"]


def test_megatron_flags_and_bad_values():
    from megatron_logra.config import parse_args_to_config

    cfg = parse_args_to_config("lm-tiny", ["--exit-signal-handler", "--exit-duration-in-mins", "1.5"])
    assert (cfg.train.exit_signal_handler, cfg.train.exit_duration_minutes) == (True, 1.5)
    assert parse_args_to_config("tiny", []).train.exit_signal_handler is False  # SIGTERM ends the process at once
    for bad in ("train.exit_duration_minutes=-1", "train.exit_duration_minutes=nan", "train.exit_duration_minutes=inf"):
        with pytest.raises(ValueError, match=r"train\.exit_duration_minutes="):
            parse_args_to_config("tiny", [bad])


def test_a_ctrl_c_that_python_drops_in_a_finalizer_is_raised_at_the_next_check(monkeypatch):
    """A KeyboardInterrupt raised inside a finalizer is dropped by Python ("Exception ignored in ..."): a Ctrl-C
    landing in one (a weakref callback during a checkpoint save, seen here) used to leave the run training."""
    from megatron_logra.train.stopping import EarlyStop, catching_interrupts

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # its handler runs here, inside the finalizer

    stop = EarlyStop(signal_handler=False, duration_minutes=0)
    before = signal.getsignal(signal.SIGINT)
    dropped = []  # what Python reports as "Exception ignored in ..." (sys.unraisablehook)
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    with catching_interrupts():
        obj = Finalized()
        del obj  # Python drops the KeyboardInterrupt, and execution goes on
        assert dropped == []  # nor is it reported as "Exception ignored": it is raised again below
        with pytest.raises(KeyboardInterrupt):
            stop.check()
    assert stop.check() is None  # outside, nothing is pending
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored
