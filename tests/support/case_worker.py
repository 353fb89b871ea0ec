"""The rank side of the distributed tests that evaluate a table of cases on a gloo world: each rank computes every
case with its rank, the world size and a group of all ranks, and rank 0 writes the results as JSON for the test to
check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["run_cases"]


def run_cases(case: Callable[..., dict], cases: Sequence[Sequence[Any]], out: str) -> None:
    """Under a launched gloo world (``torchrun``'s environment): ``case(*row, rank, world, group)`` for every row of
    ``cases``, rank 0 writing the list of results to ``out``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    results = [case(*row, rank, world, group) for row in cases]
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
