"""Launch helpers of the distributed tests: multi-rank launches as torchrun makes them (gloo on CPU).

Every launch runs with ``OMP_NUM_THREADS=1`` (2 cores shared by up to 4 ranks), a free loopback
port and a timeout; a failure raises with the tail of the output. By default the ranks are forked
from a warm interpreter (:mod:`support.forked`: torchrun's environment, none of its ~9 s of
imports per rank); ``cold=True`` starts real ``torchrun`` / ``python`` processes, for the tests of
the command lines users type.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import pytest

from support import forked

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    # torchrun variables of an enclosing launch would confuse the child
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    return env


def _kill_tree(pid: int) -> None:
    try:
        import psutil
    except ImportError:  # psutil is a dev dependency; without it, at least the launch's group goes
        os.killpg(pid, signal.SIGKILL)
        return
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _launch_cold(nproc: int, target: Sequence[str], timeout: float) -> tuple[subprocess.CompletedProcess, bool]:
    if nproc == 1:
        cmd = [sys.executable, *target]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target]
    # on timeout the whole launch (torchrun and its ranks, which torchrun may put in their own
    # sessions) is killed, so no rank outlives the test holding a port or the output pipes
    with subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_tree(popen.pid)
            stdout, stderr = popen.communicate()
            timed_out = True
    return subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr), timed_out


def launch(
    nproc: int,
    target: Sequence[str],
    *,
    timeout: float = 240,
    log: Optional[Path] = None,
    check: bool = True,
    cold: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``target`` (``[script, args...]`` or ``["-m", module, args...]``) on ``nproc`` ranks.

    ``nproc == 1`` runs as plain ``python`` would (a 1-process gloo world, no torchrun variables).
    ``cold``: start ``torchrun`` / ``python`` themselves instead of forking warm ranks.
    """
    for attempt in range(3):
        if cold or not forked.usable():
            proc, timed_out = _launch_cold(nproc, target, timeout)
        else:
            proc, timed_out = forked.run_ranks(nproc, target, env=_env(), cwd=ROOT, timeout=timeout, port=free_port())
        cmd, text = " ".join(proc.args), proc.stdout + proc.stderr
        if log is not None:
            log.write_text(f"$ {cmd}\n{text}")
        if timed_out:
            pytest.fail(f"timed out after {timeout}s: {cmd}\n{text[-4000:]}")
        if proc.returncode != 0 and "address already in use" in text.lower() and attempt < 2:
            continue  # lost the free-port race: retry on another port
        break
    if check and proc.returncode != 0:
        pytest.fail(f"exit status {proc.returncode}: {cmd}\n--- output tail ---\n{text[-6000:]}")
    return proc


def start(target: Sequence[str], *, log: Path) -> "forked.Started | subprocess.Popen":
    """Start ``python target...`` (1 process, forked warm) without waiting; output to ``log``.
    Stop it with :func:`_kill_tree` (SIGKILL to it and every child)."""
    if not forked.usable():
        return subprocess.Popen([sys.executable, *target], cwd=ROOT, env=_env(), stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return forked.start(target, env=_env(), cwd=ROOT, log=log)


def launch_worker(nproc: int, out: Path, jobs: Sequence[str], *, timeout: float = 240) -> Path:
    """Run the worker's ``jobs`` (``NAME:key=value,...``) on ``nproc`` ranks; results land in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(WORKER), "--out", str(out)]
    for job in jobs:
        args += ["--job", job]
    launch(nproc, args, timeout=timeout, log=out / "launch.log")
    return out


@pytest.fixture(scope="session")
def launcher():
    """``launcher.launch`` / ``launcher.launch_worker`` / ``launcher.free_port`` for the tests."""

    return SimpleNamespace(launch=launch, launch_worker=launch_worker, free_port=free_port, root=ROOT, start=start,
                           kill=_kill_tree)
