"""A config refused at start under a multi-node torchrun launch is reported once per launch, not once per node.

Two torchrun agents on this machine play two nodes (``--nnodes 2 --node-rank 0/1``, one rank each, static
rendezvous at rank 0's address). Rank 0 (node 0) reports the error; node 1's torchrun does not stop its rank
when node 0's fails, so that rank used to wait ``REPORT_GRACE_SECONDS`` and then report the same error itself.
It now learns from the store torchrun's agent shares with every node that rank 0 has reported, and exits with
the same status without a word, well before the grace period is over.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.distributed

MESSAGE = "megatron-logra: error: parallel.timeout_minutes=0 must be a finite number of minutes"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(k, None)
    return env


def test_refused_config_on_two_nodes_is_printed_once(launcher, tmp_path):
    from megatron_logra.cli.errors import REPORT_GRACE_SECONDS

    port = launcher.free_port()
    cli = ["-m", "megatron_logra.cli", "train", "lm-tiny", "train.steps=1", f"train.run_dir={tmp_path / 'run'}",
           "parallel.timeout_minutes=0"]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *cli]
        procs.append(subprocess.Popen(cmd, cwd=launcher.root, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    t0 = time.monotonic()
    outputs, ended = [], []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180))
            ended.append(time.monotonic() - t0)
    finally:
        for proc in procs:
            if proc.poll() is None:
                launcher.kill(proc.pid)
    stderr = [err for _, err in outputs]
    both = "\n--- node 1 ---\n".join(stderr)[-6000:]
    assert all(proc.returncode != 0 for proc in procs), both
    assert sum(err.count(MESSAGE) for err in stderr) == 1, both
    assert stderr[0].count(MESSAGE) == 1, both  # rank 0 is the one that reports
    assert stderr[1].count("exitcode  : 2") == 1, both  # node 1's rank exited with the same status, not a signal
    # node 1's rank did not sit out the grace period after node 0 had finished
    assert ended[1] - ended[0] < REPORT_GRACE_SECONDS, (ended, both)
