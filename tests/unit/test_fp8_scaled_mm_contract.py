"""The FP8 projection's call into ``torch._scaled_mm``, pinned on CPU against the installed torch.

``megatron_logra.sketch.fp8`` runs on GPUs only, but its one GEMM (``_e4m3_signed_gemm``) is the same
call on any device. Here a spy stands in front of ``torch._scaled_mm`` and checks what the CUDA kernel
requires (torch's own checks for CUDA, ``_meta_registrations._check_scaled_mm_sizes``, skip CPU
tensors): FP8 operands, ``mat1`` row-major, ``mat2`` column-major, the inner and both ``mat2`` sizes
multiples of 16, one-element fp32 scales; then the real op (CPU builds of torch >= 2.6 have it) gives
the product, which must be the exact dequantised one: ``±1`` signs are exact in E4M3 and ``X``'s
scale multiplies the product.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sketch import fp8


def _cpu_scaled_mm_works() -> bool:
    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_scaled_mm_works(), reason="this torch has no CPU torch._scaled_mm")


def test_scaled_mm_schema_has_the_keywords_the_projection_passes_and_returns_one_tensor():
    schema = torch.ops.aten._scaled_mm.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:4] == ["self", "mat2", "scale_a", "scale_b"], names
    assert "out_dtype" in names
    assert len(schema.returns) == 1  # torch < 2.5 returned (out, amax); the helper handles both


class _Spy:
    """Checks the CUDA contract of each call, then runs the real op."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, a, b, *, scale_a, scale_b, out_dtype=None, **kw):
        assert a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn
        assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
        assert a.stride(1) == 1 and a.stride(0) > 1, f"mat1 must be row-major, strides {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) > 1, f"mat2 must be column-major, strides {b.stride()}"
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
        assert a.shape[0] % 16 == 0  # padded rows (older kernels)
        for s in (scale_a, scale_b):
            assert s.dtype == torch.float32 and s.numel() == 1 and s.device == a.device
        assert out_dtype == torch.float32
        self.calls.append((tuple(a.shape), tuple(b.shape)))
        return self.real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("rows, n_in, rank", [(5, 64, 16), (32, 128, 32), (48, 32, 16)])
def test_signed_gemm_meets_the_cuda_contract_and_is_the_exact_dequantised_product(monkeypatch, rows, n_in, rank):
    spy = _Spy(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n_in, generator=gen) * 3
    x[:, 0] *= 40  # an outlier channel sets the scale
    sign = torch.where(torch.rand(rank, n_in, generator=gen) < 0.5, -1.0, 1.0)
    out, x_deq = fp8._e4m3_signed_gemm(x, sign)
    assert spy.calls == [((rows + (-rows) % 16, n_in), (n_in, rank))]
    assert out.shape == (rows, rank) and out.dtype == torch.float32 and x_deq.shape == x.shape
    # X's scale multiplies the product: the result is the fp32 product of the dequantised X with the signs
    torch.testing.assert_close(out, x_deq @ sign.t(), rtol=1e-6, atol=1e-5)
    assert float((x_deq - x).abs().max()) <= float(x.abs().max()) / 448 * 16  # E4M3 rounding of X, no more
    assert float(x_deq.abs().max()) == pytest.approx(float(x.abs().max()), rel=1e-6)  # amax maps to 448 exactly


@needs_cpu_scaled_mm
def test_signed_gemm_takes_a_transposed_sign_matrix(monkeypatch):
    """A sign matrix that is a transposed view (strides (1, r)) would make ``sign_q.t()`` row-major, which the
    CUDA kernel refuses; the helper makes it contiguous first."""
    spy = _Spy(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    sign = torch.where(torch.rand(64, 16) < 0.5, -1.0, 1.0).t()  # [16, 64], not contiguous
    x = torch.randn(16, 64)
    out, x_deq = fp8._e4m3_signed_gemm(x, sign)
    torch.testing.assert_close(out, x_deq @ sign.t(), rtol=1e-6, atol=1e-5)


def test_projection_still_refuses_cpu_tensors():
    proj = torch.ones(16, 64) / 4
    with pytest.raises(RuntimeError, match="needs a CUDA tensor"):
        fp8.fp8_projection(torch.randn(8, 64), proj)
