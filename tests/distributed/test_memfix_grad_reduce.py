"""The memory planner's data-parallel gradient-reduction buffer against the trainer's reduction.

Two gloo ranks form one data-parallel group (TP = PP = 1). Each builds the same tiny bf16 megatron GPT,
runs one forward/backward and the trainer's gradient reduction (``NativeAdamW.reduce_gradients``
all-reduces every fp32 gradient through one flat buffer). The live-tensor peak
above the start of the reduction must be the planner's ``grad_working`` at DP 2: ``4`` bytes per
parameter (larger than the norm's ``16`` bytes per element of the largest gradient in this model), and
the buffer must be gone once the next collective has run.

This file is also the worker: ``python -m torch.distributed.run --nproc-per-node 2
tests/distributed/test_memfix_grad_reduce.py OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=128,
            seq_length=32, params_dtype="bfloat16")


def _worker(out: str) -> None:
    import torch

    from megatron_logra.memory.measure import LiveTensorTracker
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim.config import NativeConfig
    from megatron_logra.optim.dense import DenseAdamW
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    groups = initialize_parallel(ParallelConfig(tp=1, backend="gloo"), seed=1)
    model = ModelConfig(**TINY)
    gpt = build_gpt(model, groups, seed=1)
    opt = DenseAdamW(gpt, NativeConfig(), groups)
    torch.manual_seed(100 + torch.distributed.get_rank())
    gpt(torch.randint(0, 128, (2, 32)), torch.arange(32)[None], None,
        labels=torch.randint(0, 128, (2, 32))).float().sum().backward()
    held = opt.native.grads()  # fp32 parameters' .grad: referenced from Python so the tracker sees them at entry
    # the probe collective's own 4-byte tensor exists before the region: gloo may or may not still hold it when
    # the region ends, and only the flat buffer's release is under test
    probe = torch.zeros(1)
    with LiveTensorTracker() as tracker:
        base = tracker.current
        opt.native.reduce_gradients(average=True)
        reduce_peak = tracker.peak - base
        # gloo keeps the last collective's tensor until the next one; prepare's next collective (the finite-flag
        # agreement) comes before the grad norm, so the flat buffer and the norm's fp64 squares never overlap
        torch.distributed.all_reduce(probe, group=groups.dp)
        after = tracker.current - base
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps({
            "dp": groups.dp_size, "params": opt.native.num_params(), "reduce_peak": reduce_peak,
            "after": after, "largest": max(p.numel() for p in opt.native.params)}))
    del held
    destroy_parallel()


def test_the_flat_all_reduce_buffer_is_planned_at_dp_2(launcher, tmp_path):
    from megatron_logra.memory.planner import plan
    from megatron_logra.models.gpt import ModelConfig

    out = tmp_path / "out.json"
    launcher.launch(2, [str(Path(__file__).resolve()), str(out)], timeout=180, log=tmp_path / "log.txt")
    got = json.loads(out.read_text())
    assert got["dp"] == 2
    n = got["params"]
    assert got["reduce_peak"] == 4 * n > 16 * got["largest"]
    w = plan(ModelConfig(**TINY), optimizer="adam", dp=2, micro_batch=2, seq_len=32, policy_sync=False).worst
    assert w.counts.total == n
    assert w.grad_working == got["reduce_peak"]
    assert got["after"] == 0
    one = plan(ModelConfig(**TINY), optimizer="adam", dp=1, micro_batch=2, seq_len=32, policy_sync=False).worst
    assert one.grad_working == 16 * got["largest"]  # DP 1: no flat buffer, only the norm's fp64 square


if __name__ == "__main__":
    _worker(sys.argv[1])
