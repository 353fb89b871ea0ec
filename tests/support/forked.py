"""Test processes forked from one warm interpreter instead of started cold.

A cold ``python`` on the 2-core CI machine spends ~9 s importing torch, megatron-core and
transformers before it runs a line of the code under test, and the distributed tests start
dozens of such processes (every rank of every launch). Here a ``multiprocessing`` fork server
imports those libraries once per test session; every rank is a ``fork`` of it. The fork server
has imported but never computed (no OpenMP pool, no process group, nothing of
``megatron_logra``), so each child starts exactly as a fresh interpreter would after its
imports: it sets its own environment, working directory, ``sys.argv``, thread count and RNG
seeds, then runs the target script or module as ``__main__``.

:func:`run_ranks` replaces ``torchrun --nproc-per-node N script ...`` (``nproc == 1``: plain
``python script ...``): the same ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*``
variables, each rank's output captured, every rank stopped when one fails (as torchrun's agent
does) and the whole launch killed on timeout. Tests that exercise the torchrun launcher itself
keep launching it for real.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["usable", "context", "run_ranks", "rank_env", "apply_fresh_state", "Started", "start", "Python", "run_python",
           "python"]

# what a cold start of a test process spends its time importing; none reads the environment a
# rank sets (RANK, MASTER_PORT, ...) at import time
PRELOAD = [
    "numpy", "yaml", "torch", "torch.distributed", "safetensors.torch", "transformers",
    "megatron.core", "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
]
_GRACE_S = 1.0  # after a rank fails, how long the others may still finish before they are stopped


def usable() -> bool:
    """Whether ranks may be forked here: not where CUDA is visible, since the fork server's imports
    may touch the CUDA driver and CUDA cannot be used in a child forked after that (the CPU tiers
    hide CUDA, so there they always are)."""
    import torch

    return not torch.cuda.is_available()


def context() -> mp.context.BaseContext:
    """The fork-server context with the shared imports preloaded (they load when it first starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def apply_fresh_state(env: Mapping[str, str], cwd: str | os.PathLike | None = None) -> None:
    """Make a forked child look like a process started cold with ``env``: the environment, the
    working directory, warnings as ``PYTHONWARNINGS`` asks, one intra-op thread per
    ``OMP_NUM_THREADS`` and fresh seeds for the generators a cold start seeds from the OS."""
    import random
    import warnings

    import numpy as np
    import torch

    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    random.seed()
    np.random.seed()


def rank_env(base: Mapping[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """``base`` plus the variables torchrun sets for ``rank`` of a one-node ``world``."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
    })
    return env


def _run_target(target: Sequence[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    import runpy

    for fd, path in ((1, out_path), (2, err_path)):  # appending: both may be one file
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    apply_fresh_state(env, cwd)
    if target[0] == "-c":  # as ``python -c CODE args...``: argv[0] is "-c", the working directory first on the path
        sys.argv = ["-c", *target[2:]]
        sys.path.insert(0, "")
        exec(compile(target[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        sys.path.insert(0, cwd)
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path.insert(0, str(Path(target[0]).resolve().parent))
        runpy.run_path(target[0], run_name="__main__")


class Started:
    """A forked ``python target...`` running in the background, with the ``subprocess.Popen``
    methods the tests use (``pid``, ``poll``, ``wait``, ``returncode``)."""

    def __init__(self, process: mp.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        code = self._process.exitcode
        return code if code is None or code >= 0 else 128 - code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self.returncode


def start(target: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike, log: Path) -> Started:
    """Fork ``python target...`` (one process, output to ``log``) without waiting for it."""
    Path(log).write_text("")
    p = context().Process(target=_run_target, args=(list(target), dict(env), str(cwd), str(log), str(log)))
    p.start()
    return Started(p)


def _run_python(target: Sequence[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    """:func:`_run_target`, then the ``atexit`` handlers a cold interpreter runs at its exit (a forked child
    leaves through ``os._exit``, which skips them)."""
    import atexit

    try:
        _run_target(target, env, cwd, out_path, err_path)
    finally:
        atexit._run_exitfuncs()


class Python:
    """``subprocess.Popen([sys.executable, *target], stdout=PIPE, stderr=PIPE, text=True)`` forked from the
    warm fork server instead (``target``: ``[script, args...]``, ``["-m", module, args...]`` or
    ``["-c", code, args...]``): its own process, environment, working directory and output, none of a cold
    interpreter's imports. ``communicate`` / ``poll`` / ``wait`` / ``kill`` / ``returncode`` as ``Popen``'s;
    ``stdout_so_far()`` reads what it has printed while it runs."""

    def __init__(self, target: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike | None = None) -> None:
        self.args = ["<forked>", *target]
        self._logs = Path(tempfile.mkdtemp(prefix="forked-"))
        self._out, self._err = self._logs / "out", self._logs / "err"
        self._out.write_text("")
        self._err.write_text("")
        self._process = context().Process(target=_run_python, args=(list(target), dict(env), str(cwd or os.getcwd()),
                                                                    str(self._out), str(self._err)))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # killed by a signal: -N, as Popen reports it

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        _stop([self._process], signal.SIGKILL)

    def stdout_so_far(self) -> str:
        return self._out.read_text(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = self._out.read_text(errors="replace"), self._err.read_text(errors="replace")
        for path in (self._out, self._err):
            path.unlink(missing_ok=True)
        self._logs.rmdir()
        return out, err


def run_python(target: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike | None = None,
               timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *target], capture_output=True, text=True, timeout=timeout)`` with the
    process forked warm (:class:`Python`); on timeout it is killed and ``subprocess.TimeoutExpired`` raised."""
    proc = Python(target, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def python(target: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
           timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *target], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)``:
    forked warm (:func:`run_python`) where ranks may be forked (:func:`usable`), else started cold. For tests of a
    command's outputs and exit status, not of what a fresh interpreter imports. ``env``: ``os.environ`` if None."""
    env = dict(os.environ if env is None else env)
    if usable():
        return run_python(target, env=env, cwd=cwd, timeout=timeout)
    return subprocess.run([sys.executable, *target], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def _stop(procs: list, sig: int) -> None:
    try:
        import psutil
    except ImportError:
        psutil = None
    for p in procs:
        if p.exitcode is not None:
            continue
        kids = []
        if psutil is not None:
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for pid in [p.pid, *(k.pid for k in kids)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def run_ranks(nproc: int, target: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike,
              timeout: float, port: int) -> tuple[subprocess.CompletedProcess, bool]:
    """Run ``target`` (``[script, args...]`` or ``["-m", module, args...]``) on ``nproc`` forked
    ranks; returns the launch (stdout / stderr of the ranks in rank order, the first failing
    rank's exit status or 0) and whether it timed out."""
    ctx = context()
    logs = Path(tempfile.mkdtemp(prefix="forked-"))
    procs, paths = [], []
    for rank in range(nproc):
        renv = dict(env) if nproc == 1 else rank_env(env, rank, nproc, port)
        out, err = logs / f"rank{rank}.out", logs / f"rank{rank}.err"
        paths.append((out, err))
        p = ctx.Process(target=_run_target, args=(list(target), renv, str(cwd), str(out), str(err)),
                        name=f"rank{rank}")
        p.start()
        procs.append(p)
    deadline, timed_out, failed_at = time.monotonic() + timeout, False, None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            timed_out = True
            break
        if failed_at is not None and now > failed_at + _GRACE_S:
            break
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.1)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
    _stop(procs, signal.SIGTERM)
    for p in procs:
        p.join(5)
    _stop(procs, signal.SIGKILL)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    returncode = next((c if c > 0 else 128 - c for c in codes if c != 0), 0)
    stdout = "".join(o.read_text(errors="replace") for o, _ in paths)
    stderr = "".join(e.read_text(errors="replace") for _, e in paths)
    for o, e in paths:
        o.unlink()
        e.unlink()
    logs.rmdir()
    cmd = ["<forked>", *(["torchrun", "--nproc-per-node", str(nproc)] if nproc > 1 else []), *target]
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr), timed_out
