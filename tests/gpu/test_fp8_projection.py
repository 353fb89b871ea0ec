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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_fp8_projection(x: torch.Tensor, proj: torch.Tensor) -> dict:
    """Every assertion on ``fp8_projection`` and ``fp8_projection_error`` for ``x`` ``[T, n_in]`` and a
    Rademacher ``proj`` ``[r, n_in]``.

    The reference is computed here, independently of the code under test: ``X`` scaled per tensor so that
    ``amax`` maps to 448 (E4M3's largest value), rounded by torch's own ``float8_e4m3fn`` cast, scaled
    back, and projected in fp64. Absolute bounds keep a broken projection (all zeros, say) from passing
    on relative ones alone. Returns the error dict for printing."""
    from megatron_logra.sketch import fp8

    scale = x.abs().max().double() / 448.0
    x_ref = ((x.double() / scale).float().to(torch.float8_e4m3fn).double() * scale)
    exact = x.double() @ proj.double().t()
    rounded = x_ref @ proj.double().t()  # what an FP8 GEMM with exact accumulation returns
    x_rounding = _rel(x_ref, x)
    # E4M3 keeps 3 mantissa bits: rounding costs a few percent of ‖X‖ (measured 0.0265 on this input)
    assert 0.01 < x_rounding < 0.05, x_rounding

    out, x_deq = fp8.fp8_projection(x, proj, return_dequantized=True)
    assert out.shape == (x.shape[0], proj.shape[0]) and out.dtype == torch.float32
    assert _rel(x_deq, x_ref) < 1e-3  # the dequantised X the GEMM saw is X rounded to E4M3
    assert _rel(out, rounded) < 1e-3  # the GEMM adds only accumulation error (order 1e-5, see sketch.fp8)
    assert _rel(out, exact) < 0.05  # absolute: within E4M3's rounding of the exact projection

    e = fp8.fp8_projection_error(x, proj)
    assert e["sign_exact"] == 1.0
    assert abs(e["x_quantization"] - x_rounding) < 0.01 * x_rounding
    assert abs(e["fp8_vs_fp32"] - _rel(out, exact)) < 1e-6 + 1e-3 * e["fp8_vs_fp32"]
    assert e["x_quantization"] < 0.05 and e["fp8_vs_fp32"] < 0.05
    # A is exact in E4M3: what the GEMM adds is accumulation error, a small fraction of X's rounding
    assert e["projection_added"] < 0.01 * e["x_quantization"]
    assert e["fp8_vs_fp32"] <= 1.1 * e["x_quantization"] + 1e-6  # the rest is X's E4M3 rounding
    assert e["bf16_vs_fp32"] < e["fp8_vs_fp32"]
    return e


def test_fp8_projection_adds_no_error_beyond_rounding_x():
    from megatron_logra.sketch.random_projection import projection

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, generator=gen, device="cuda")
    x[:, :8] *= 20  # activation outliers in a few channels, as in LLMs
    proj = projection(5, "model.layers.0.mlp.down_proj", 0, 128, 2048, device="cuda")
    print("FP8 projection errors:", check_fp8_projection(x, proj))


def test_fp8_projection_refuses_gaussian_projections_and_cpu_tensors():
    from megatron_logra.sketch.fp8 import fp8_projection

    gauss = torch.randn(16, 64, device="cuda")
    with pytest.raises(ValueError, match="Rademacher"):
        fp8_projection(torch.randn(32, 64, device="cuda"), gauss)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        fp8_projection(torch.randn(32, 64), torch.ones(16, 64))
