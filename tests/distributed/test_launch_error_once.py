"""A config refused at start under a multi-process launch is reported once (rank 0), not once per rank.

Every rank parses the same command line, so a refused override or a ``ValueError`` of a config's
``__post_init__`` fails on each of them alike; the launch exits with status 2 and the error appears in
stderr exactly once, the other ranks stopping without a word.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.distributed

CLI = ["-m", "megatron_logra.cli", "train", "lm-tiny", "train.steps=1"]


def test_post_init_error_under_torchrun_is_printed_once(launcher, tmp_path):
    """Real ``torchrun`` (``python -m torch.distributed.run``), 2 gloo ranks, a value a config's
    ``__post_init__`` refuses."""
    proc = launcher.launch(2, [*CLI, f"train.run_dir={tmp_path / 'run'}", "parallel.timeout_minutes=0"],
                           check=False, cold=True, timeout=180)
    assert proc.returncode != 0, proc.stderr[-3000:]
    message = "megatron-logra: error: parallel.timeout_minutes=0 must be a finite number of minutes"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert proc.stderr.count("usage: megatron-logra") == 1, proc.stderr[-3000:]
    # torchrun's failure report: the rank that failed first exited with status 2; the other exited with 2 as well,
    # or, when torchrun saw the first exit before the other rank's own, was stopped by torchrun's SIGTERM
    codes = re.findall(r"exitcode  : (-?\d+)", proc.stderr)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]


def test_bad_override_on_two_ranks_is_printed_once_and_both_exit_2(launcher, tmp_path):
    """Two ranks as torchrun starts them (forked warm), an override naming no field: one report, status 2."""
    proc = launcher.launch(2, [*CLI, f"train.run_dir={tmp_path / 'run'}", "rl.no_such_field=3"], check=False,
                           timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("megatron-logra: error:") == 1, proc.stderr[-3000:]
    assert "rl.no_such_field" in proc.stderr, proc.stderr[-3000:]
