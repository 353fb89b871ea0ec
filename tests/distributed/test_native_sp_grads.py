"""Native AdamW sums sequence-parallel partial grads of TP-replicated parameters over TP.

Under sequence parallelism a TP rank sees only its slice of the sequence, so the gradient of a
parameter replicated over TP (a norm weight, marked ``sequence_parallel`` as megatron-core and
TransformerEngine do) is partial on each rank. Two gloo ranks form one TP group (DP = 1): after
``reduce_gradients`` the marked parameter's gradient equals the sum of both ranks' gradients on
both ranks, an unmarked one is left alone, and an AdamW step leaves the marked weights identical.

This file is also the worker: ``python -m torch.distributed.run --nproc-per-node 2
tests/distributed/test_native_sp_grads.py OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed


def _worker(out: str) -> None:
    from megatron_logra.optim.native import NativeAdamW
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    groups = initialize_parallel(ParallelConfig(tp=2, backend="gloo"), seed=1)
    rank = groups.tp_rank
    marked = torch.nn.Parameter(torch.ones(5))
    marked.sequence_parallel = True
    plain = torch.nn.Parameter(torch.ones(3))
    opt = NativeAdamW([marked, plain], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=groups)
    g_marked = torch.arange(5, dtype=torch.float32) * (rank + 1)  # rank 0: 0..4, rank 1: 0..8
    g_plain = torch.full((3,), float(rank + 1))
    marked.grad, plain.grad = g_marked.clone(), g_plain.clone()
    opt.reduce_gradients(average=False)
    opt.step()
    both = [torch.empty(5) for _ in range(2)]
    torch.distributed.all_gather(both, marked.detach().clone(), group=groups.tp)
    if rank == 0:
        Path(out).write_text(json.dumps({"marked_grad": marked.grad.tolist(), "plain_grad": plain.grad.tolist(),
                                         "weights_equal": bool(torch.equal(both[0], both[1]))}))
    destroy_parallel()


def test_sequence_parallel_partial_grads_are_summed_over_tp(launcher, tmp_path):
    out = tmp_path / "out.json"
    launcher.launch(2, [str(Path(__file__).resolve()), str(out)], timeout=180, log=tmp_path / "log.txt")
    got = json.loads(out.read_text())
    expected = (torch.arange(5, dtype=torch.float32) * 3).tolist()  # rank 0 + rank 1
    assert got["marked_grad"] == expected
    assert got["plain_grad"] == [1.0, 1.0, 1.0]  # rank 0's own: not a sequence-parallel parameter
    assert got["weights_equal"]


if __name__ == "__main__":
    _worker(sys.argv[1])
