"""The launch this CLI process runs in: its rank and world size as the launcher (torchrun) set them, and the
logging each rank gets.

Read from the environment before any process group exists (a process group's own values win where one does:
:func:`launch_world_size`); an environment the trainer would refuse reads as one process of rank 0 here, and
:func:`megatron_logra.parallel.launch_rank_and_world` reports it when the job starts.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

__all__ = ["is_rank0", "launch_rank", "launch_world_size", "peer_rank", "setup_logging"]


def launch_rank() -> int:
    """This process's ``RANK`` as a launcher set it; 0 when unset or not an integer (the job then refuses the
    launch with an error naming the variable: :func:`megatron_logra.parallel.launch_rank_and_world`)."""
    try:
        return int(os.environ.get("RANK", "").strip() or 0)
    except ValueError:
        return 0


def is_rank0() -> bool:
    """Whether this process is rank 0 of its launch (or runs without a launcher): the one that prints results."""
    return launch_rank() == 0


def peer_rank() -> Optional[int]:
    """This process's rank when it is one of ranks 1..N-1 of a multi-process launch (``RANK`` and ``WORLD_SIZE``
    both integers, ``0 < RANK < WORLD_SIZE``); None for rank 0, for one process and for an inconsistent launch
    environment (which every rank reports itself: :func:`megatron_logra.parallel.launch_rank_and_world`)."""
    try:
        rank, world = int(os.environ.get("RANK", "").strip()), int(os.environ.get("WORLD_SIZE", "").strip())
    except ValueError:
        return None
    return rank if 0 < rank < world else None


def launch_world_size() -> int:
    """The number of processes this launch runs (as :func:`megatron_logra.parallel.init_distributed` will see it):
    the process group's when one exists, else torchrun's ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def setup_logging() -> None:
    """Root logging for a command: INFO on rank 0, WARNING on the other ranks; megatron-core's import-time
    warnings about optional packages silenced."""
    rank = launch_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # megatron-core warns at import and build time that TE/apex are absent (expected on CPU)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    # its Megatron-FSDP package announces itself at import (INFO); this trainer does not use FSDP
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
