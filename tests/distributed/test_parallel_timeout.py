"""``parallel.timeout_minutes`` reaches megatron's process groups, not only the world (2 gloo processes).

megatron-core gives every group it creates (tensor, pipeline, data, model parallel) its own
``distributed_timeout_minutes``, 30 unless told otherwise; a rank waiting in one of them (a non-driver
rank while its driver generates a long evaluation) is aborted by that limit, whatever the world's is.
The timeout is read from each group's backend options (a private attribute: what torch keeps).
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed


def _timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60


def _worker(rank: int, world: int, out: str, minutes: int) -> None:
    from megatron.core import parallel_state as ps

    from megatron_logra import cpu_shim
    from megatron_logra.parallel import ParallelConfig, initialize_parallel

    cpu_shim.activate()  # what init_distributed does on a CPU; the world here is the test's own
    groups = initialize_parallel(ParallelConfig(tp=2, timeout_minutes=minutes), seed=1)
    try:
        got = {name: _timeout(getattr(groups, name)) for name in ("tp", "pp", "dp", "mp")}
    finally:
        ps.destroy_model_parallel()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


def test_every_megatron_group_takes_the_configured_timeout(tmp_path):
    minutes = 95
    assert datetime.timedelta(minutes=minutes) != datetime.timedelta(minutes=30)
    spawn_group(_worker, 2, tmp_path, str(tmp_path), minutes)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"tp": minutes, "pp": minutes, "dp": minutes, "mp": minutes}, (rank, got)
