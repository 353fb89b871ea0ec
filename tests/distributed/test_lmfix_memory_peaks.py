"""The memory peaks in metrics are the largest over all ranks (2 gloo ranks on CPU): under pipeline
parallelism the last stage, which holds the logits, often has the peak, not rank 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_logra.metrics import device_peaks, max_over_ranks, reset_device_peaks
from support.gloo import spawn_group

pytestmark = pytest.mark.distributed

PER_RANK = [
    {"gpu_memory_peak_bytes": 5 * 2**30, "gpu_memory_reserved_peak_bytes": 6 * 2**30, "absent": None},
    {"gpu_memory_peak_bytes": 9 * 2**30, "gpu_memory_reserved_peak_bytes": 2**30, "absent": None},
]


def _max_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    got = {"world": max_over_ranks(PER_RANK[rank])}
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in the same order
    solo = groups[rank]
    got["solo"] = max_over_ranks(PER_RANK[rank], solo)  # a group of one: this rank's own values
    got["cpu"] = device_peaks(torch.device("cpu"))  # no collective off CUDA (only rank 0 would hang here)
    Path(f"{out}.{rank}").write_text(json.dumps(got))


def test_peaks_are_reduced_with_max_over_every_rank(tmp_path):
    out = str(tmp_path / "result")
    spawn_group(_max_worker, 2, tmp_path, out)
    want = {key: None if all(r[key] is None for r in PER_RANK) else max(r[key] for r in PER_RANK if r[key] is not None)
            for key in PER_RANK[0]}
    assert want == {"gpu_memory_peak_bytes": 9 * 2**30, "gpu_memory_reserved_peak_bytes": 6 * 2**30, "absent": None}
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["world"] == want  # every rank logs the same, largest values
        assert got["solo"] == PER_RANK[rank]
        assert got["cpu"] == {"gpu_memory_peak_bytes": None, "gpu_memory_reserved_peak_bytes": None}


def test_without_a_process_group_the_values_are_returned_as_they_are():
    assert max_over_ranks(PER_RANK[0]) == PER_RANK[0]


def _gpu_worker(rank: int, world: int, out: str) -> None:
    device = torch.device("cuda", 0)
    reset_device_peaks(device)
    block = torch.empty((rank + 1) * 64 * 2**20, dtype=torch.uint8, device=device)  # rank 1 holds twice as much
    own = int(torch.cuda.max_memory_allocated(device))
    del block
    Path(f"{out}.{rank}").write_text(json.dumps({"own": own, "logged": device_peaks(device)}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_peaks_of_every_rank_reach_the_record(tmp_path):
    """Two gloo ranks sharing one GPU, with different peaks: both record the larger."""
    out = str(tmp_path / "result")
    spawn_group(_gpu_worker, 2, tmp_path, out)
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert results[1]["own"] > results[0]["own"]
    for r in results:
        assert r["logged"]["gpu_memory_peak_bytes"] == max(x["own"] for x in results)
        assert r["logged"]["gpu_memory_reserved_peak_bytes"] >= r["logged"]["gpu_memory_peak_bytes"]
