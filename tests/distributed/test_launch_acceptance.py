"""Multi-process launches as a cluster user starts them: a layout or a launch environment that cannot work is
refused at start (``megatron-logra: error: ...``, exit status 2) naming what to change, instead of waiting the whole
collective timeout for ranks that never come, running as one process in silence, or failing inside torch.

Real processes (forked warm ranks or a plain interpreter, as ``tests/distributed/conftest.py`` launches them), gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from support import forked

pytestmark = pytest.mark.distributed

CLI = ["-m", "megatron_logra.cli", "train", "lm-tiny", "train.steps=1"]


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _one_process(launcher, extra_env: dict, args: list, timeout: float = 90):
    """``python args...`` as one process with ``extra_env`` on top of the test environment (no launcher: the
    RANK / WORLD_SIZE / MASTER_* variables are exactly the ones given); returns (launch, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra_env)
    t0 = time.monotonic()
    if forked.usable():
        proc, timed_out = forked.run_ranks(1, args, env=env, cwd=launcher.root, timeout=timeout,
                                           port=launcher.free_port())
    else:
        try:
            proc = subprocess.run([sys.executable, *args], cwd=launcher.root, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired as exc:
            proc, timed_out = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", exc.stderr or ""), True
    assert not timed_out, f"still running after {timeout}s (waiting for ranks that never come?)"
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("extra_env, named", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),  # ran as one process in silence
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "RANK=2 is outside 0..1"),  # waited 30 minutes
    ({"RANK": "abc", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "RANK='abc' is not an integer"),  # a traceback
], ids=["world-without-rank", "rank-without-world", "rank-past-world", "rank-not-an-integer"])
def test_inconsistent_launch_environment_is_refused_at_start(launcher, tmp_path, extra_env, named):
    if "MASTER_ADDR" in extra_env:
        extra_env = {**extra_env, "MASTER_PORT": str(launcher.free_port())}  # nobody listens there
    proc, seconds = _one_process(launcher, extra_env, [*CLI, f"train.run_dir={tmp_path / 'run'}", "parallel.timeout_minutes=1"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"megatron-logra: error: {named}" in proc.stderr, proc.stderr[-3000:]
    assert "torchrun --nproc-per-node" in proc.stderr and "Traceback" not in proc.stderr
    assert seconds < 45, seconds  # at start, not after the 1-minute rendezvous timeout


def test_rank0_of_a_world_of_one_runs_without_master_addr(launcher, tmp_path):
    """``RANK=0 WORLD_SIZE=1`` (a launcher's single-process job) needs no rendezvous: it used to fail in torch
    (``environment variable MASTER_ADDR expected, but not set``)."""
    run = tmp_path / "run"
    proc, _ = _one_process(launcher, {"RANK": "0", "WORLD_SIZE": "1"}, [*CLI, f"train.run_dir={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "summary.json").exists()


def test_world_size_not_divisible_by_tp_names_values_that_fit(launcher, tmp_path):
    """``--nproc-per-node 3`` with TP2: every rank stops at start with a layout that fits this launch and the launch
    that fits the given layout."""
    t0 = time.monotonic()
    proc = launcher.launch(3, [*CLI, "--tensor-model-parallel-size", "2", f"train.run_dir={tmp_path / 'run'}"],
                           check=False, timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    assert "megatron-logra: error: parallel.tp=2 × parallel.pp=1 = 2 does not divide the world size 3" in err, err
    assert "set parallel.tp=1 (--tensor-model-parallel-size 1)" in err and "torchrun --nproc-per-node 2" in err, err
    assert seconds < 60, seconds


TIMEOUT_PROBE = '''
import os
import sys
import torch
import torch.distributed as dist
from megatron_logra.parallel import _MAX_TIMEOUT_MINUTES, ParallelConfig, destroy_parallel, initialize_parallel

groups = initialize_parallel(ParallelConfig(tp=2, timeout_minutes=_MAX_TIMEOUT_MINUTES), seed=1)
total = torch.ones(1)
dist.all_reduce(total, group=groups.tp)
destroy_parallel(wait_for_peers=True)
os.write(1, f"sum {int(total.item())}\\n".encode())  # one write: the two ranks share torchrun's stdout
'''


def test_largest_accepted_timeout_works_across_processes(launcher, tmp_path):
    """The largest ``parallel.timeout_minutes`` accepted must be one torch.distributed can wait: a value that
    overflowed its nanosecond clock made the rendezvous time out at once (``timed out after -...ms``)."""
    script = tmp_path / "timeout_probe.py"
    script.write_text(TIMEOUT_PROBE)
    proc = launcher.launch(2, [str(script)], check=False, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("sum 2") == 2, proc.stdout
