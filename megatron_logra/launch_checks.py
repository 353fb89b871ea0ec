"""Checks of a launch: what the environment, the devices and the layout must be before process groups exist.

Owns the pure decisions :func:`megatron_logra.parallel.init_distributed` and
:func:`~megatron_logra.parallel.initialize_parallel` make from the launch alone, each a clear error instead of a
rendezvous that waits out the collective timeout or a crash at the first collective: the rank and world size of
a multi-process launch (:func:`launch_rank_and_world`: torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT``), the CUDA device each process takes (:func:`local_device_index`), pipeline parallelism a
backend cannot carry (:func:`check_backend_layout`), a backend the machine cannot run
(:func:`check_backend_available`) and the message for a ``tp`` × ``pp`` that does not divide
the world (:func:`layout_error`), and tensor-parallel groups that cross nodes (:func:`tp_spans_nodes`). No torch.distributed or megatron-core state is read or made here; the names
stay importable from :mod:`megatron_logra.parallel`.
"""

from __future__ import annotations

import math
import os
from typing import Optional


def local_device_index(local_rank: int, num_devices: int, backend: str, bound: bool = False) -> int:
    """The CUDA device a process takes: its ``LOCAL_RANK`` among the node's visible devices, or device 0 where
    the launcher bound one GPU to each process (``bound``: ``CUDA_VISIBLE_DEVICES`` set and one device
    visible, e.g. ``srun --gpus-per-task=1``, which still numbers ``LOCAL_RANK`` 0..N-1 on the node).
    ``RuntimeError`` under NCCL for a ``LOCAL_RANK`` past the visible devices otherwise (more processes than
    GPUs); gloo shares them round-robin."""
    if bound and num_devices == 1:
        return 0
    if local_rank >= num_devices and backend == "nccl":
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this node has {num_devices} visible CUDA devices: "
                           "NCCL needs one GPU per process (torchrun --nproc-per-node <= GPUs), or set "
                           "parallel.backend=gloo")
    return local_rank % num_devices


def check_backend_layout(backend: str, cuda: bool, pp: int) -> None:
    """Refuse pipeline parallelism over gloo where the model sits on CUDA devices (``ValueError`` naming the
    fields): gloo's point-to-point send and receive hand the tensor's raw pointer to its TCP transport, which
    cannot read device memory, so the first activation sent between stages would fail or crash."""
    if backend == "gloo" and cuda and pp > 1:
        raise ValueError(f"parallel.backend=gloo with parallel.pp={pp} on a CUDA machine: gloo cannot send CUDA "
                         "activations between pipeline stages; use parallel.backend=nccl (or auto)")


def check_backend_available(backend: str, cuda: bool, nccl_built: bool) -> None:
    """Refuse ``parallel.backend=nccl`` where it cannot run (``ValueError`` naming the field and the fix): NCCL
    communicates between CUDA devices, so it needs a visible CUDA device (``cuda``) and a torch built with it
    (``nccl_built``); without, ``init_process_group`` fails with a traceback from inside torch."""
    if backend != "nccl" or (cuda and nccl_built):
        return
    why = "this machine has no visible CUDA device" if not cuda else "this torch build has no NCCL"
    raise ValueError(f"parallel.backend=nccl: {why}; use parallel.backend=auto (NCCL with CUDA GPUs, else gloo) "
                     f"or parallel.backend=gloo")


_LAUNCH_HINT = "torchrun --nproc-per-node N -m megatron_logra.cli ... sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"


def launch_rank_and_world() -> Optional[tuple[int, int]]:
    """``(RANK, WORLD_SIZE)`` of a multi-process launch (torchrun, or a launcher that sets the same variables), or
    None for one process: neither is set, ``WORLD_SIZE=1``, or ``RANK=0`` alone.

    ``ValueError`` naming the variable for a launch no rendezvous could complete -- it would otherwise wait the whole
    collective timeout (30 minutes by default) for ranks that never come, or run as one process in silence: one of
    RANK / WORLD_SIZE set without the other, a value that is no integer, a RANK outside ``0 .. WORLD_SIZE-1``, or
    MASTER_ADDR / MASTER_PORT missing."""
    raw = {name: os.environ.get(name, "").strip() for name in ("RANK", "WORLD_SIZE")}
    values = {}
    for name, text in raw.items():
        if text:
            try:
                values[name] = int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not an integer: the launcher sets it ({_LAUNCH_HINT}); "
                                 f"unset RANK and WORLD_SIZE to run one process") from None
    rank, world = values.get("RANK"), values.get("WORLD_SIZE")
    if world is None:
        if rank in (None, 0):
            return None
        raise ValueError(f"RANK={rank} is set but WORLD_SIZE is not: a multi-process launch sets both "
                         f"({_LAUNCH_HINT}); unset RANK to run one process")
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be >= 1 (the number of processes of the launch; {_LAUNCH_HINT})")
    if rank is None:
        if world == 1:
            return None
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: every process of a launch needs its own RANK "
                         f"0..{world - 1} ({_LAUNCH_HINT}); unset WORLD_SIZE (or set WORLD_SIZE=1) to run one process")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world}): no rank {rank} exists in a "
                         f"launch of {world} processes, and the others would wait for it until the collective "
                         f"timeout; give each process a RANK from 0 to {world - 1} ({_LAUNCH_HINT})")
    if world == 1:
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
    if missing:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world} without {' and '.join(missing)}: the ranks meet at rank 0's "
                         f"MASTER_ADDR:MASTER_PORT; set {' and '.join(missing)} the same on every rank "
                         f"({_LAUNCH_HINT})")
    return rank, world


def layout_error(tp: int, pp: int, world: int) -> str:
    """The message for a ``tp`` × ``pp`` that does not divide ``world`` processes: the values that fit this launch
    (divisors of the given ones, so the model still splits) and the launch that fits the given ones."""
    fit_pp = math.gcd(pp, world)
    fit_tp = math.gcd(tp, world // fit_pp)
    flags = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size"}
    changes = [(name, value) for name, value, given in (("tp", fit_tp, tp), ("pp", fit_pp, pp)) if value != given]
    fields = " ".join(f"parallel.{name}={value}" for name, value in changes)
    spelled = " ".join(f"{flags[name]} {value}" for name, value in changes)
    launched = "one process (no torchrun)" if world == 1 else f"{world} processes"
    return (f"parallel.tp={tp} × parallel.pp={pp} = {tp * pp} does not divide the world size {world} ({launched}): "
            f"set {fields} ({spelled}) for this launch, or launch a multiple of {tp * pp} processes "
            f"(torchrun --nproc-per-node {tp * pp} -m megatron_logra.cli ...)")


def tp_spans_nodes(tp: int, world: int, local_world: Optional[int]) -> Optional[str]:
    """A warning when the tensor-parallel groups of a multi-node launch cross nodes; None otherwise.

    megatron-core makes each TP group of ``tp`` consecutive ranks, and torchrun numbers the ranks node by node
    (``local_world`` = ``LOCAL_WORLD_SIZE`` per node), so a group stays inside a node exactly when ``tp`` divides
    ``local_world``. A group that crosses nodes runs every layer's all-reduces over the network instead of
    NVLink: it trains correctly, many times slower, which is why Megatron-LM layouts keep TP within a node and let
    PP and DP span nodes."""
    if not local_world or local_world < 1 or world <= local_world or local_world % tp == 0:
        return None
    fits = max(d for d in range(1, min(tp, local_world) + 1) if local_world % d == 0 and tp % d == 0)
    return (f"parallel.tp={tp} spans nodes: torchrun runs {local_world} processes per node (LOCAL_WORLD_SIZE) and "
            f"{world} in all, so each TP group's all-reduces cross the network; keep parallel.tp a divisor of "
            f"{local_world} (e.g. --tensor-model-parallel-size {fits}) and spread the rest over "
            f"--pipeline-model-parallel-size and data parallelism")
