"""Spawned gloo process groups for the distributed tests (2–4 processes on CPU).

:func:`spawn_group` runs ``fn(rank, world, *args)`` on every rank of a fresh gloo world (file
rendezvous: a probed TCP port can be taken by another process before gloo binds it). A rank that
returns waits at a barrier before teardown, so no rank shuts gloo down while a peer's last send is
still in flight — that aborted the peer in C++ ("terminate called without an active exception").
A rank that raises skips the barrier; ``torch.multiprocessing`` then stops the others and
re-raises its error in the test. The ranks are forked from the warm fork server of
:mod:`support.forked` (imports done once per session; spawned cold where CUDA is visible) and
start from the test's environment and working directory, as spawned ones would.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from support import forked

__all__ = ["spawn_group"]


def spawn_group(fn: Callable[..., None], world: int, tmp_dir: str | Path, *args: Any,
                tensor_parallel: bool = False, timeout_s: float = 180.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks of one gloo group; ``fn`` must be a
    module-level function. ``tensor_parallel``: also initialise megatron-core with TP = ``world`` on
    CPU (``cpu_shim``) and tear it down after. Results go through files under ``tmp_dir``."""
    rendezvous = Path(tempfile.mkdtemp(prefix="gloo-", dir=tmp_dir)) / "rendezvous"
    if forked.usable():
        forked.context()
    mp.start_processes(_entry, args=(fn, world, str(rendezvous), args, tensor_parallel, timeout_s, dict(os.environ),
                                     os.getcwd()), nprocs=world, join=True,
                       start_method="forkserver" if forked.usable() else "spawn")


def _entry(rank: int, fn: Callable[..., None], world: int, rendezvous: str, args: tuple, tensor_parallel: bool,
           timeout_s: float, env: dict[str, str], cwd: str) -> None:
    forked.apply_fresh_state({**env, "OMP_NUM_THREADS": "1"}, cwd)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    returned = False
    try:
        if tensor_parallel:
            _init_tensor_parallel(world)
        fn(rank, world, *args)
        returned = True
    finally:
        if returned:
            dist.barrier()
        if tensor_parallel:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.destroy_process_group()


def _init_tensor_parallel(world: int) -> None:
    from megatron_logra import cpu_shim

    cpu_shim.activate()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
