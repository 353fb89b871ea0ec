"""The FP8 projection ``X·Aᵀ`` on a GPU (``torch._scaled_mm``; TransformerEngine not needed).

Rademacher signs are exact in E4M3, so the FP8 GEMM's error against fp64 is the rounding of ``X``
to E4M3 plus the GEMM's accumulation, which must stay a small fraction of it. Skipped without CUDA
or below compute capability 8.9.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device with FP8 GEMMs (compute capability >= 8.9)"),
]


def test_fp8_projection_adds_no_error_beyond_rounding_x():
    from megatron_logra.sketch.fp8 import fp8_projection_error
    from megatron_logra.sketch.random_projection import projection

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, generator=gen, device="cuda")
    x[:, :8] *= 20  # activation outliers in a few channels, as in LLMs
    proj = projection(5, "model.layers.0.mlp.down_proj", 0, 128, 2048, device="cuda")
    e = fp8_projection_error(x, proj)
    print("FP8 projection errors:", e)
    assert e["sign_exact"] == 1.0
    # A is exact in E4M3: what the GEMM adds is accumulation error, a small fraction of X's rounding
    assert e["projection_added"] < 0.01 * e["x_quantization"]
    assert e["fp8_vs_fp32"] <= 1.1 * e["x_quantization"] + 1e-6  # the rest is X's E4M3 rounding
    assert e["bf16_vs_fp32"] < e["fp8_vs_fp32"]


def test_fp8_projection_refuses_gaussian_projections_and_cpu_tensors():
    from megatron_logra.sketch.fp8 import fp8_projection

    gauss = torch.randn(16, 64, device="cuda")
    with pytest.raises(ValueError, match="Rademacher"):
        fp8_projection(torch.randn(32, 64, device="cuda"), gauss)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        fp8_projection(torch.randn(32, 64), torch.ones(16, 64))
