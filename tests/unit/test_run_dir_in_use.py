"""A new run, or a resume, in a run directory another job is training in is refused, and the message fits both:
wait for that job, or choose another ``train.run_dir``. A new run used to be told to wait "before resuming"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from support.cli import exit_2, one_process_cli  # noqa: F401
from support.run_fixtures import run_recipe

_HOLDER = """
import sys, time
from megatron_logra.checkpoint.run_dir import lock_run_dir
assert lock_run_dir(sys.argv[1]) is None
print("locked", flush=True)
time.sleep(120)
"""


def test_a_run_directory_in_use_is_refused_with_a_message_for_a_new_run_and_a_resume(tmp_path, capsys):
    run = tmp_path / "run"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=2", "train.progress=false"])
    other = tmp_path / "other"
    other.mkdir()
    # the job training in RUN (its lock), and a new run started in a directory another job holds
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(d)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}) for d in (run, other)]
    try:
        assert all(h.stdout.readline().strip() == "locked" for h in holders)
        for argv in (["train", "--resume", str(run), "train.steps=4"],
                     ["train", "lm-tiny", f"train.run_dir={other}"]):
            err = exit_2(argv, capsys)
            assert "is in use by another running job" in err, err
            assert "before starting another there, or choose another train.run_dir" in err, err
            assert "before resuming" not in err, err
    finally:
        for h in holders:
            h.send_signal(signal.SIGKILL)
            h.wait(timeout=30)
