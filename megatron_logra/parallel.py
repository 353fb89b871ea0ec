"""Process groups: the only module that creates or reads megatron-core's global parallel state.

Everything else receives a :class:`ParallelGroups` and passes its groups explicitly. The checks of a launch made
before any group exists (environment, device, layout) live in :mod:`megatron_logra.launch_checks` and are
importable from here.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_logra import cpu_shim
from megatron_logra.launch_checks import (check_backend_available, check_backend_layout, launch_rank_and_world,
                                          layout_error, local_device_index, tp_spans_nodes)

logger = logging.getLogger(__name__)

__all__ = ["ParallelConfig", "ParallelGroups", "init_distributed", "initialize_parallel", "destroy_parallel",
           "local_device_index", "check_backend_available", "check_backend_layout", "cpu_group", "all_reduce_sum",
           "all_gather_bytes", "group_size", "group_rank", "world_group", "launch_rank_and_world", "layout_error"]


@dataclass
class ParallelConfig:
    """Parallel layout. World size = tp × pp × dp."""

    tp: int = 1
    """Tensor-parallel size (Megatron-LM: --tensor-model-parallel-size)."""
    pp: int = 1
    """Pipeline-parallel size (Megatron-LM: --pipeline-model-parallel-size)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, else gloo), nccl or gloo."""
    timeout_minutes: int = 30
    """Collective timeout in minutes (>= 1)."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"parallel.tp={self.tp} must be >= 1")
        if self.pp < 1:
            raise ValueError(f"parallel.pp={self.pp} must be >= 1")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend={self.backend!r}: choose auto, nccl or gloo")
        _check_timeout(self.timeout_minutes)


_MAX_TIMEOUT_MINUTES = 10_000_000
"""About 19 years. torch.distributed keeps a timeout in signed 64-bit nanoseconds (and adds it to the clock): past
about 1.5e8 minutes it wraps to a negative one, and the rendezvous fails at once with "timed out after -...ms"."""


def _check_timeout(value) -> None:
    """``parallel.timeout_minutes`` must be a finite number of minutes from 1 to :data:`_MAX_TIMEOUT_MINUTES`
    (0 or less times every collective out at once; NaN passes every ``<`` comparison; a larger one overflows)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and 1 <= value <= _MAX_TIMEOUT_MINUTES):
        raise ValueError(f"parallel.timeout_minutes={value!r} must be a finite number of minutes from 1 to "
                         f"{_MAX_TIMEOUT_MINUTES:.0f} (the collective timeout; default 30)")


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def world_group() -> Optional[dist.ProcessGroup]:
    """Every rank's group (``dist.group.WORLD``), or None (this process alone) without a process group."""
    return dist.group.WORLD if dist.is_initialized() else None


_GLOO_MIRRORS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_TIMEOUT = datetime.timedelta(minutes=30)  # init_distributed's, for the groups made here


def cpu_group(group: Any) -> Any:
    """``group`` itself where it runs on gloo (or is None or one rank); else a gloo group of the same ranks.

    For exchanges of host data and for waiting on one rank: the other ranks of a model-parallel group
    wait in such a collective while their driver generates rollouts, and in an NCCL collective each of
    them would keep a kernel spinning on its GPU all that time -- the GPUs an in-process SGLang engine
    of the replica generates on -- and stage the pickled payload in GPU memory. The gloo twin is made on
    first use by the group's ranks alone (``use_local_synchronization``: every rank of ``group`` must
    call, as for any collective on it) and kept until :func:`destroy_parallel`.
    """
    if group is None or group_size(group) == 1 or dist.get_backend(group) == "gloo":
        return group
    return _gloo_mirror(group)


def _gloo_mirror(group: Any) -> dist.ProcessGroup:
    ranks = tuple(dist.get_process_group_ranks(group))
    mirror = _GLOO_MIRRORS.get(ranks)
    if mirror is None:
        mirror = dist.new_group(list(ranks), backend="gloo", timeout=_TIMEOUT, use_local_synchronization=True)
        _GLOO_MIRRORS[ranks] = mirror
    return mirror


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where tensors of a collective on ``group`` must live: the current CUDA device under NCCL, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """In-place sum over ``group`` (no-op for a missing or single-member group). Host tensors
    (loop statistics) go through the GPU when the group is NCCL, which reduces device memory only."""
    if group_size(group) > 1:
        device = collective_device(group)
        if tensor.device.type == "cpu" and device.type == "cuda":
            on_device = tensor.to(device)
            dist.all_reduce(on_device, group=group)
            tensor.copy_(on_device)
        else:
            dist.all_reduce(tensor, group=group)
    return tensor


def all_gather_bytes(payload: bytes, group: Optional[dist.ProcessGroup]) -> list[bytes]:
    """Every rank's ``payload`` (any lengths), in group rank order; ``[payload]`` without a group."""
    if group_size(group) == 1:
        return [payload]
    device = collective_device(group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload else \
        torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(group_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    bufs = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(bufs, padded, group=group)
    return [bytes(b[: int(s.item())].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]


@dataclass
class ParallelGroups:
    """Process groups of one rank. ``None`` groups mean "this rank alone"."""

    tp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    mp: Optional[dist.ProcessGroup] = None
    """Model-parallel group (tp × pp): agreement on skipped steps, global norms."""
    embedding: Optional[dist.ProcessGroup] = None
    """First and last pipeline stage (tied word embeddings)."""
    pp_first: bool = True
    pp_last: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def pp_rank(self) -> int:
        return group_rank(self.pp)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp)

    @property
    def is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0


def init_distributed(backend: str = "auto", timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a 1-process world.

    ``backend=nccl`` where NCCL cannot run (no CUDA device) is a ValueError naming the field
    (:func:`~megatron_logra.launch_checks.check_backend_available`).

    A single process without torchrun variables gets a gloo world of size 1 on a free
    loopback port, so megatron-core's parallel state can be built the same way.
    """
    global _TIMEOUT
    if dist.is_initialized():
        return
    _TIMEOUT = datetime.timedelta(minutes=timeout_minutes)
    check_backend_available(backend, torch.cuda.is_available(), dist.is_nccl_available())
    if not torch.cuda.is_available():
        cpu_shim.activate()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = _TIMEOUT
    launch = launch_rank_and_world()
    if launch is not None:
        rank, world = launch
        if torch.cuda.is_available():  # also under gloo: the model goes to the current device
            torch.cuda.set_device(local_device_index(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count(),
                                                     backend, bound=bool(os.environ.get("CUDA_VISIBLE_DEVICES"))))
        try:
            dist.init_process_group(backend=backend, timeout=timeout)
        except dist.DistError as exc:
            where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            raise RuntimeError(
                f"rank {rank} of WORLD_SIZE={world} could not meet the other ranks at MASTER_ADDR:MASTER_PORT={where} "
                f"within parallel.timeout_minutes={timeout.total_seconds() / 60:g} ({str(exc).strip().rstrip('.')}): "
                f"start all {world} ranks "
                f"with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (torchrun --nproc-per-node {world} "
                "-m megatron_logra.cli ... sets them), RANK 0 reachable there") from exc
    else:
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    logger.info("torch.distributed: backend=%s world=%d", backend, dist.get_world_size())


def initialize_parallel(cfg: ParallelConfig, seed: int = 1234) -> ParallelGroups:
    """Build megatron-core's model-parallel groups and return them as :class:`ParallelGroups`.

    Also seeds megatron's tensor-parallel RNG tracker (dropout inside TP regions).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    init_distributed(cfg.backend, cfg.timeout_minutes)
    check_backend_layout(dist.get_backend(), torch.cuda.is_available(), cfg.pp)
    world = dist.get_world_size()
    if world % (cfg.tp * cfg.pp) != 0:
        raise ValueError(layout_error(cfg.tp, cfg.pp, world))
    spans = tp_spans_nodes(cfg.tp, world, _local_world_size())
    if spans and dist.get_rank() == 0:
        logger.warning(spans)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
                                 distributed_timeout_minutes=math.ceil(cfg.timeout_minutes))  # else 30 on its groups
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        mp=ps.get_model_parallel_group(),
        embedding=ps.get_embedding_group(check_initialized=False) if cfg.pp > 1 else None,
        pp_first=ps.is_pipeline_first_stage(ignore_virtual=True),
        pp_last=ps.is_pipeline_last_stage(ignore_virtual=True),
    )
    logger.info("parallel layout: tp=%d pp=%d dp=%d", groups.tp_size, groups.pp_size, groups.dp_size)
    return groups


def _local_world_size() -> Optional[int]:
    """torchrun's processes per node (``LOCAL_WORLD_SIZE``); None outside torchrun or when unreadable."""
    try:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def destroy_parallel(wait_for_peers: bool = False) -> None:
    """Tear down megatron's groups and the default process group.

    ``wait_for_peers``: pass True after a run that succeeded on every rank. The ranks meet at a
    barrier first, so no rank shuts its communicators down while a peer's last send is still in
    flight (gloo then aborts the peer in C++, and the launcher reports a failure at the very end of
    a good run). After an error it must stay False: the other ranks may never arrive.
    """
    from megatron.core import parallel_state as ps

    if wait_for_peers and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _GLOO_MIRRORS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
