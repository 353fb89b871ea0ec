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

__all__ = ["E4M3_MAX", "FP8_MULTIPLE", "check_fp8_shapes", "rademacher_signs", "fp8_projection", "fp8_projection_error"]

E4M3_MAX = 448.0
FP8_MULTIPLE = 16
"""``torch._scaled_mm`` needs both dimensions of its second operand (here ``[n_in, r]``) divisible by 16."""


def check_fp8_shapes(n_in: int, rank: int) -> None:
    """Refuse shapes ``torch._scaled_mm`` cannot take, before it is called: ``n_in`` (the target's input
    width, e.g. ``model.hidden_size``) and the sketch rank ``r`` (``optimizer.logra.rank``, ``--rank`` of
    ``tools/gpu_smoke.py``) must both be multiples of 16. ``ValueError`` naming the offending value(s)
    and the nearest valid ones; returns ``None`` otherwise (pure, no device needed)."""
    bad = []
    for what, value in (("the input width n_in (model.hidden_size / ffn_hidden_size, --hidden)", n_in),
                        ("the sketch rank r (optimizer.logra.rank, --rank)", rank)):
        if value < 1 or value % FP8_MULTIPLE:
            down = value - value % FP8_MULTIPLE
            choices = f"{down} or {down + FP8_MULTIPLE}" if down > 0 else f"{FP8_MULTIPLE}"
            bad.append(f"{what}={value} (choose e.g. {choices})")
    if bad:
        raise ValueError(f"the FP8 projection (torch._scaled_mm) needs n_in and r to be multiples of "
                         f"{FP8_MULTIPLE}: {'; '.join(bad)}")


def rademacher_signs(proj_RI: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(sign, c)`` with ``proj = c·sign`` and ``sign ∈ {±1}``; ``ValueError`` for any other matrix."""
    # sign() and an equality test, not proj / c: CUDA divides by a scalar through its reciprocal,
    # so c · (1/c) can miss 1 by an ulp and a true Rademacher matrix would be refused
    c = float(proj_RI.abs().max())
    if c == 0.0 or not bool((proj_RI.abs() == c).all()):
        raise ValueError("the FP8 projection needs a Rademacher projection (entries ±c); "
                         "optimizer.logra.distribution=gaussian is not exact in FP8")
    return torch.sign(proj_RI), c


def _pad_rows(x: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x


def fp8_projection(x: torch.Tensor, proj_RI: torch.Tensor, *, return_dequantized: bool = False):
    """``X·Aᵀ`` (fp32, ``[T, r]``) by one E4M3 GEMM with per-tensor scaling of ``X``.

    ``x``: ``[..., n_in]`` on a CUDA device with FP8 support; ``proj_RI``: ``[r, n_in]``. ``n_in`` and
    ``r`` must be multiples of 16 (:func:`check_fp8_shapes`; ``ValueError`` before any GEMM). With
    ``return_dequantized`` also returns the fp32 ``X`` the GEMM actually saw.
    """
    if proj_RI.dim() != 2 or proj_RI.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_projection: the projection has shape {tuple(proj_RI.shape)}, expected "
                         f"[r, n_in] with n_in = x.shape[-1] = {x.shape[-1]}")
    check_fp8_shapes(int(x.shape[-1]), int(proj_RI.shape[0]))
    if not x.is_cuda:
        raise RuntimeError("fp8_projection needs a CUDA tensor (torch._scaled_mm)")
    sign, c = rademacher_signs(proj_RI.float())
    out, x_deq = _e4m3_signed_gemm(x.reshape(-1, x.shape[-1]).float(), sign)
    out = out * c
    if return_dequantized:
        return out, x_deq
    return out


def _e4m3_signed_gemm(x2: torch.Tensor, sign: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(deq(q(X))·signᵀ, deq(q(X)))`` in fp32 by one ``torch._scaled_mm``: ``x2`` ``[T, n_in]`` fp32,
    ``sign`` ``[r, n_in]`` of ``±1``, ``n_in`` and ``r`` multiples of 16 (checked by the caller).

    The contract of ``torch._scaled_mm`` (torch >= 2.5; also on CPU builds that have it, which is how
    the unit tests pin it): ``mat1`` row-major FP8 with ``size(1) % 16 == 0``, ``mat2`` column-major FP8
    with both sizes multiples of 16 (``sign_q.t()`` of a contiguous ``[r, n_in]`` is), per-tensor
    scales as one-element fp32 tensors that *multiply* the product (the dequantisation scales), one
    tensor back (torch < 2.5 returned ``(out, amax)``). Rows are padded to 16 for the older kernels'
    ``size(0)`` requirement and cut off again."""
    rows = x2.shape[0]
    amax = float(x2.abs().max().clamp_min(1e-30))
    scale_x = torch.tensor(amax / E4M3_MAX, dtype=torch.float32, device=x2.device)
    xq = _pad_rows((x2 / scale_x).to(torch.float8_e4m3fn))
    sign_q = sign.to(device=x2.device, dtype=torch.float8_e4m3fn).contiguous()
    one = torch.ones((), dtype=torch.float32, device=x2.device)
    out = torch._scaled_mm(xq, sign_q.t(), scale_a=scale_x, scale_b=one, out_dtype=torch.float32)
    if isinstance(out, tuple):  # torch < 2.5 also returned amax
        out = out[0]
    return out[:rows], xq[:rows].float() * scale_x


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
