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


@pytest.mark.parametrize("rank,decay", [(32, 1.0), (48, 0.999), (128, 1.0)])
def test_the_fp32_merge_is_the_same_bits_on_cuda_and_the_cpu_fused_kernel(rank, decay):
    """The CPU takes the fused GEMM-and-subtract where its BLAS rounds once, CUDA the two-kernel form;
    ``V = grid(s·U)`` is computed on each device. Both must give ``W ⊖ V·sign(A)`` bit for bit."""
    from megatron_logra.sketch.random_projection import projection
    from megatron_logra.sync.apply import low_rank_merge_
    from megatron_logra.sync.factors import quantize_factor

    gen = torch.Generator().manual_seed(rank)
    n_out, n_in = 2048, 1536
    W = torch.randn(n_out, n_in, generator=gen) * 0.02
    U = quantize_factor(1e-4 * torch.randn(n_out, rank, generator=gen) * torch.logspace(-3, 3, n_out)[:, None])
    A = projection(7, "model.layers.1.self_attn.o_proj", 0, rank, n_in)
    cpu, gpu = W.clone(), W.cuda()
    low_rank_merge_(cpu, U, A, decay=decay)
    low_rank_merge_(gpu, U.cuda(), A.cuda(), decay=decay)
    assert not torch.equal(cpu, W)
    assert torch.equal(gpu.cpu(), cpu)


def test_the_merge_is_exact_on_cuda_with_tf32_matmuls_allowed():
    """A process that allows TF32 (``set_float32_matmul_precision("high")``) would round ``V`` to 10
    mantissa bits inside cuBLAS; the merge must still give the CPU's IEEE bits, and hand the process its
    TF32 setting back."""
    from megatron_logra.sketch.random_projection import projection
    from megatron_logra.sync.apply import low_rank_merge_
    from megatron_logra.sync.factors import quantize_factor, rademacher_scale, rademacher_signs, scaled_factor

    gen = torch.Generator().manual_seed(5)
    n_out, n_in, rank = 2048, 2048, 32
    W = torch.randn(n_out, n_in, generator=gen) * 0.02
    U = quantize_factor(1e-3 * torch.randn(n_out, rank, generator=gen))
    A = projection(9, "model.layers.2.mlp.down_proj", 0, rank, n_in)
    V = scaled_factor(U, rademacher_scale(rank)).cuda()
    B = rademacher_signs(A)[0].cuda()
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        tf32_product = V @ B
        exact = (V.double() @ B.double()).float()
        cpu, gpu = W.clone(), W.cuda()
        low_rank_merge_(cpu, U, A)
        low_rank_merge_(gpu, U.cuda(), A.cuda())
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        if torch.equal(tf32_product, exact):
            pytest.skip("this GPU computes fp32 matmuls in IEEE even with TF32 allowed (pre-Ampere)")
        assert torch.equal(gpu.cpu(), cpu)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_the_fused_kernel_check_runs_on_cuda_and_catches_a_second_rounding():
    """The check measures ``addmm_`` on the GPU itself: a kernel that adds the rank terms into ``W`` one at a
    time is refused there, the two-kernel form is accepted, and cuBLAS's own verdict for a real shape is the
    one the merge then uses (the merges above compare its bits with the CPU's)."""
    from megatron_logra.sync import fused

    cuda = torch.device("cuda")

    def accumulate_into_w(W, V, B):
        for k in range(V.shape[1]):
            W.sub_(V[:, k : k + 1] * B[k : k + 1, :])

    assert not fused.agrees(256, 512, 32, kernel=accumulate_into_w, device=cuda)
    assert fused.agrees(256, 512, 32, kernel=lambda W, V, B: W.sub_(V @ B), device=cuda)
    verdict = fused.fused_merge_ok(cuda, 2048, 1536, 32)
    assert verdict == fused.agrees(2048, 1536, 32, device=cuda)
