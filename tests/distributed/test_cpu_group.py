"""Gloo twins of process groups (``parallel.cpu_group``), over a real gloo world of 4 processes.

Under NCCL every model-parallel group gets a gloo twin on first use, made by that group's ranks alone
while other groups make theirs at other times (or never). Here the world is gloo, so ``cpu_group`` gives
each group back as it is; the twin-making path (``_gloo_mirror``) is run directly on the groups megatron
would make for TP 2 (pairs), in a different order on each pair, and on the world: each twin carries its
own driver's object to exactly its ranks, and a second call returns the same twin.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch.distributed as dist

from megatron_logra import parallel
from support.gloo import spawn_group

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, out: str) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, as megatron does
    mine = pairs[rank // 2]
    assert parallel.cpu_group(mine) is mine and parallel.cpu_group(None) is None  # already gloo
    if rank >= 2:
        time.sleep(0.5)  # the second pair makes its twin later: the first must not wait for it
    twin = parallel._gloo_mirror(mine)
    assert parallel._gloo_mirror(mine) is twin and twin is not mine
    assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(mine)
    box = [f"from {rank}"] if dist.get_rank(twin) == 0 else [None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(twin, 0), group=twin)
    everyone = parallel._gloo_mirror(dist.group.WORLD)
    seen: list = [None] * world
    dist.all_gather_object(seen, box[0], group=everyone)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"pair": box[0], "world": seen}, fh)


def test_gloo_twins_are_made_per_group_and_carry_each_groups_data(tmp_path):
    spawn_group(_worker, 4, tmp_path, str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [g["pair"] for g in got] == ["from 0", "from 0", "from 2", "from 2"]
    assert all(g["world"] == ["from 0", "from 0", "from 2", "from 2"] for g in got)
