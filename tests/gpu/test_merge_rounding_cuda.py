"""The sketch-delta merge with stochastic rounding gives the same bits on a GPU as on the CPU.

Its noise is an int32 hash (wrapping multiplies, masked shifts) and its rounding an int32 add and mask
on the fp32 bit pattern: a trainer on one kind of device and an engine on another (a CPU consumer of
the directory transport) must still agree bitwise. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_bf16_merge_rounds_the_same_on_cuda_and_cpu():
    from megatron_logra.sketch.random_projection import projection
    from megatron_logra.sync.apply import StochasticRounding, low_rank_merge_
    from megatron_logra.sync.factors import quantize_factor

    gen = torch.Generator().manual_seed(0)
    n_out, n_in, r = 1536, 2048, 64
    W = torch.randn(n_out, n_in, generator=gen).to(torch.bfloat16)
    U = quantize_factor(1e-3 * torch.randn(n_out, r, generator=gen))
    A = projection(11, "model.layers.3.mlp.down_proj", 5, r, n_in)
    rows = torch.randperm(n_out, generator=gen)
    noise = StochasticRounding(11, "model.layers.3.mlp.down_proj", 5, rows=rows, col_start=4096)
    cpu, gpu = W.clone(), W.cuda()
    low_rank_merge_(cpu, U, A, rounding=noise)
    low_rank_merge_(gpu, U.cuda(), A.cuda(), rounding=noise)
    assert not torch.equal(cpu, W)
    assert torch.equal(gpu.cpu(), cpu)
