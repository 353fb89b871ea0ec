"""The projection GEMM ``P = X·Aᵀ`` in FP8, and how far it lands from the fp32 projection.

A Rademacher ``A`` is ``c·sign`` with ``c = 1/√r`` and ``sign ∈ {±1}``: ``±1`` is exact in
``float8_e4m3fn``, so ``A`` enters an FP8 GEMM with no rounding at all (``c`` is applied to the fp32
output). ``X`` is scaled per tensor into E4M3's range (``amax → 448``) and rounded; that rounding is
the only error of the FP8 projection beyond the GEMM's accumulation. :func:`fp8_projection_error`
measures both parts: FP8 vs fp32 ``X·Aᵀ``, and FP8 vs the fp32 product of the *dequantised* ``X``
with ``A`` (the error ``A`` and the GEMM add). Hopper's FP8 tensor cores accumulate each short run
of products with about 14 mantissa bits before cuBLAS promotes the partial sums to fp32 (without
``use_fast_accum``), so that part is of order 1e-5 relative, not fp32's 1e-7: still about a
thousandth of what rounding ``X`` to E4M3 costs.

GPU only: ``torch._scaled_mm`` needs an FP8-capable GPU (compute capability >= 8.9). Gaussian
projections are not exact in FP8 and are rejected.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["E4M3_MAX", "rademacher_signs", "fp8_projection", "fp8_projection_error"]

E4M3_MAX = 448.0


def rademacher_signs(proj_RI: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(sign, c)`` with ``proj = c·sign`` and ``sign ∈ {±1}``; ``ValueError`` for any other matrix."""
    c = float(proj_RI.abs().max())
    sign = proj_RI / c
    if c == 0.0 or not bool((sign.abs() == 1).all()):
        raise ValueError("the FP8 projection needs a Rademacher projection (entries ±c); "
                         "optimizer.logra.distribution=gaussian is not exact in FP8")
    return sign, c


def _pad_rows(x: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x


def fp8_projection(x: torch.Tensor, proj_RI: torch.Tensor, *, return_dequantized: bool = False):
    """``X·Aᵀ`` (fp32, ``[T, r]``) by one E4M3 GEMM with per-tensor scaling of ``X``.

    ``x``: ``[..., n_in]`` on a CUDA device with FP8 support; ``n_in`` and ``r`` multiples of 16.
    With ``return_dequantized`` also returns the fp32 ``X`` the GEMM actually saw.
    """
    if not x.is_cuda:
        raise RuntimeError("fp8_projection needs a CUDA tensor (torch._scaled_mm)")
    sign, c = rademacher_signs(proj_RI.float())
    x2 = x.reshape(-1, x.shape[-1]).float()
    rows = x2.shape[0]
    amax = float(x2.abs().max().clamp_min(1e-30))
    scale_x = torch.tensor(amax / E4M3_MAX, dtype=torch.float32, device=x.device)
    xq = _pad_rows((x2 / scale_x).to(torch.float8_e4m3fn))
    sign_q = sign.to(device=x.device, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    out = torch._scaled_mm(xq, sign_q.t(), scale_a=scale_x, scale_b=one, out_dtype=torch.float32)
    if isinstance(out, tuple):  # torch < 2.5 also returned amax
        out = out[0]
    out = out[:rows] * c
    if return_dequantized:
        return out, xq[:rows].float() * scale_x
    return out


@torch.no_grad()
def fp8_projection_error(x: torch.Tensor, proj_RI: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius errors of the FP8 projection (and of a bf16 one, for scale).

    Keys: ``fp8_vs_fp32`` (FP8 GEMM vs fp64 ``X·Aᵀ``), ``bf16_vs_fp32`` (bf16 ``X`` and ``A``),
    ``x_quantization`` (``‖X − deq(q(X))‖ / ‖X‖``), ``projection_added`` (FP8 GEMM vs the fp64 product
    of the dequantised ``X`` with ``A``: the error that ``A`` and the GEMM add) and ``sign_exact``
    (1.0 when ``sign(A)`` survives the E4M3 round trip bit for bit).
    """
    x2 = x.reshape(-1, x.shape[-1]).float()
    proj = proj_RI.to(device=x.device, dtype=torch.float32)
    ref = x2.double() @ proj.double().t()
    out, x_deq = fp8_projection(x2, proj, return_dequantized=True)
    ref_deq = x_deq.double() @ proj.double().t()
    bf16 = (x2.bfloat16() @ proj.bfloat16().t()).double()
    sign, _ = rademacher_signs(proj)
    sign_exact = torch.equal(sign.to(torch.float8_e4m3fn).float(), sign)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))

    return {
        "fp8_vs_fp32": rel(out, ref),
        "bf16_vs_fp32": rel(bf16, ref),
        "x_quantization": rel(x_deq, x2.double()),
        "projection_added": rel(out, ref_deq),
        "sign_exact": 1.0 if sign_exact else 0.0,
    }
