"""Trainer-side TP gather of column-parallel factors over a real gloo group of 2 processes.

Each rank holds its shard of a bf16 ``U`` laid out like megatron's ``linear_fc1`` (partition
stride 2: ``[gate_k; up_k]``) and of ``linear_qkv`` (stride 1); ``models.layout.gather_tp`` must return the
full Megatron-order tensor bit for bit (it gathers the raw 16-bit words).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed


class _Param:
    def __init__(self, stride, dim=0):
        self.tensor_model_parallel, self.partition_dim, self.partition_stride = True, dim, stride


def _sharded(local, stride, dim):
    """A tensor carrying megatron's TP attributes, like a ``ColumnParallelLinear``/``RowParallelLinear`` weight."""
    t = local.clone()
    t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, dim, stride
    return t


def _worker(rank: int, world: int, result_dir: str) -> None:
    from megatron_logra.models.layout import shard_full
    from megatron_logra.sync.apply import quantize_factor
    from megatron_logra.models.layout import gather_tp as _gather_tp

    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, rows, stride in (("fc1", 24, 2), ("qkv", 16, 1), ("fc1_bias", 24, 2)):
        full = quantize_factor(torch.randn(rows, 8, generator=gen))
        if name.endswith("bias"):  # a 1-D bf16 dense parameter
            full = full[:, 0].contiguous()
        local = shard_full(full, name, _Param(stride), rank, world).contiguous()
        gathered = _gather_tp(local, _Param(stride), dist.group.WORLD)
        out[name] = bool(gathered.dtype == torch.bfloat16 and torch.equal(gathered.view(torch.int16), full.view(torch.int16)))
    from megatron_logra.models.layout import full_rows

    rows = [5, 0, 23, 11, 12, 5]  # unsorted, repeated, across both ranks and both stride blocks
    for name, stride, dim, dtype in (("rows_fc1", 2, 0, torch.bfloat16), ("rows_qkv", 1, 0, torch.float32),
                                     ("rows_proj", 1, 1, torch.bfloat16)):
        full = torch.randn(24, 16, generator=gen).to(dtype)
        local = _sharded(shard_full(full, name, _Param(stride, dim), rank, world).contiguous(), stride, dim)
        got = full_rows(local, rows, dist.group.WORLD)
        want = full[rows]
        out[name] = bool(got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)))
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


def test_column_parallel_factors_gather_bitwise_over_gloo(tmp_path):
    spawn_group(_worker, 2, tmp_path, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results == [{"fc1": True, "qkv": True, "fc1_bias": True, "rows_fc1": True, "rows_qkv": True,
                         "rows_proj": True}] * 2
