"""Update factors on the exact-sum grid, and the projection split the merge multiplies.

``quantize_factor(α·D)`` rounds to bf16 (nearest even) and then each row onto the grid
``q_i = 2^(e_i + L − 24)`` (``2^(e_i−1) <= max_k |U_ik| < 2^e_i``, ``L = ceil(log2 r)``; rows
whose max is below ``2^-100`` become zero). Entries of at least ``2^-(15−L)``·rowmax keep their
bf16 value; smaller ones move by at most ``2^-(24−L)``·rowmax. Every partial sum of ``±U_ik`` over a row is then
an integer multiple of ``q_i`` below ``2^24·q_i``, exactly representable in fp32, so the
product with a Rademacher sign matrix is exact whatever the GEMM's order or blocking (see
:mod:`megatron_logra.sync.apply`). Imports only torch.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "rademacher_scale", "quantize_factor", "off_grid_rows", "check_factor", "check_factors", "split_projection",
    "rademacher_signs", "scaled_factor", "scaled_factor_rows",
]

_TINY_ROW_EXP = -100
_TINY_ROW_BIASED = _TINY_ROW_EXP + 127
"""Biased fp32 exponent of ``2^-100``: a row max below it has a smaller exponent field."""
_BATCH_ELEMS = 1 << 20
"""Elements per batch of :func:`check_factors` (2 MiB of bf16: its temporaries stay in cache)."""


@functools.lru_cache(maxsize=64)
def rademacher_scale(rank: int) -> float:
    """``s = fp32(1/sqrt(r))``: the magnitude of every entry of a Rademacher projection."""
    return float(torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32))


def _grid_bits(rowmax_O1: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``q``, ``1/q``, kept-row mask, non-finite-row mask), each ``[n_out, 1]``, of fp32 row maxima ``>= 0``.

    Built from the exponent field with integer operations: for ``2^(e−1) <= rowmax < 2^e`` the biased
    exponent is ``E = e + 126``, so ``q = 2^(e + L − 24) = 2^(E − 150 + L)`` and ``1/q = 2^(150 − L − E)``,
    both normal for every kept row (``E >= 27``: ``rowmax >= 2^-100``); tiny rows get ``q = 1/q = 0``.
    """
    L = max(0, math.ceil(math.log2(rank)))
    # few ops on these [n_out, 1] tensors: each costs a dispatch, not bandwidth
    E_O1 = rowmax_O1.contiguous().view(torch.int32) >> 23  # rowmax >= 0 or NaN: 255 for inf/NaN
    keep_O1 = E_O1 >= _TINY_ROW_BIASED
    keep32_O1 = keep_O1.to(torch.int32)
    q_O1 = E_O1.add(L - 23).bitwise_left_shift_(23).mul_(keep32_O1).view(torch.float32)
    inv_q_O1 = E_O1.neg().add_(277 - L).clamp_(min=0).bitwise_left_shift_(23).mul_(keep32_O1).view(torch.float32)
    return q_O1, inv_q_O1, keep_O1, E_O1 == 255


def _row_grid_of(rowmax: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid ``q`` ``[n_out, 1]``, tiny-row mask ``[n_out, 1]``) of rows whose max magnitude is ``rowmax``
    (``q = 0`` on tiny rows, which become zero)."""
    q, _, keep, _ = _grid_bits(rowmax, rank)
    return q, ~keep


def _row_grid(U32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid ``q`` ``[n_out, 1]``, tiny-row mask ``[n_out, 1]``) of fp32 factors ``U32`` ``[n_out, r]``."""
    return _row_grid_of(U32.abs().amax(dim=1, keepdim=True), U32.shape[1])


@torch.no_grad()
def quantize_factor(X_OR: torch.Tensor) -> torch.Tensor:
    """bf16 factor ``U`` of an fp32 ``α·D`` ``[n_out, r]`` on the exact-sum grid (module docstring)."""
    U32 = X_OR.to(torch.bfloat16).float()
    q, tiny = _row_grid(U32)
    U32 = torch.where(tiny, torch.zeros_like(U32), torch.round(U32 / q) * q)
    return U32.to(torch.bfloat16)


@torch.no_grad()
def scaled_factor(U_OR: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """fp32 ``V = grid(s ⊙ U)`` ``[n_out, r]``: the factor the merge multiplies by ``sign(A)``.

    ``s ⊙ U`` is one correctly rounded fp32 product per entry; each row is then rounded (nearest
    even) onto its own exact-sum grid, as :func:`quantize_factor` does (rows below ``2^-100``
    become zero), so ``V·sign(A)`` is exact whatever the GEMM's order or blocking, and the merge
    subtracts it with a single rounding. Folding ``s`` in before the GEMM instead of after it is
    what lets one BLAS call (:mod:`megatron_logra.sync.fused`) do the whole merge. It moves each
    entry by at most ``2^-(25−L)``·rowmax, far below the bf16 rounding ``U`` already carries. Every
    step is exact or one IEEE operation, so trainer and engine get the same ``V`` on any device.
    ``scale`` None (Gaussian projections): ``U`` itself in fp32.
    """
    return scaled_factor_rows(U_OR, scale)[0]


@torch.no_grad()
def scaled_factor_rows(U_OR: torch.Tensor, scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`scaled_factor` of ``U_OR``, ``[n_out]`` bool: rows holding a NaN or inf).

    For a bf16 ``U`` the row maxima come from the bit patterns (an int16 max of the magnitude bits
    orders finite values by size and puts inf/NaN above them); ``max_k fp32(s·|U_ik|)`` is
    ``fp32(s·max_k |U_ik|)`` since rounding is monotonic; the grid comes from :func:`_grid_bits`.
    """
    if scale is None:
        V = U_OR.to(torch.float32).contiguous()
        return V, ~torch.isfinite(V).all(dim=1)
    n_out, rank = U_OR.shape
    if U_OR.dtype == torch.bfloat16:
        mag_O1 = (U_OR.contiguous().view(torch.int16) & 0x7FFF).amax(dim=1, keepdim=True)
        rowmax_O1 = mag_O1.view(torch.bfloat16).to(torch.float32).mul_(scale)
        X = U_OR.to(torch.float32).mul_(scale)
    else:
        X = U_OR.to(torch.float32) * scale
        rowmax_O1 = torch.maximum(X.amax(dim=1, keepdim=True), X.amin(dim=1, keepdim=True).neg())
    if n_out == 0:
        return X, torch.zeros(0, dtype=torch.bool, device=X.device)
    q_O1, inv_q_O1, _, bad_O1 = _grid_bits(rowmax_O1, rank)
    return X.mul_(inv_q_O1).round_().mul_(q_O1), bad_O1[:, 0]


def off_grid_rows(U_OR: torch.Tensor) -> int:
    """Number of rows of ``U_OR`` that are not on the exact-sum grid (0 for ``quantize_factor`` output)."""
    if U_OR.dtype == torch.bfloat16 and U_OR.dim() == 2:
        return check_factor(U_OR)[1]
    U32 = U_OR.float()
    q, tiny = _row_grid(U32)
    on = torch.where(tiny, U32 == 0, torch.round(U32 / q) * q == U32)
    return int((~on.all(dim=1)).sum())


@torch.no_grad()
def check_factor(U_OR: torch.Tensor) -> tuple[bool, int]:
    """``(all entries finite, rows off the exact-sum grid)`` of a bf16 factor ``U_OR`` ``[n_out, r]``.

    See :func:`check_factors` (this is the one-factor case).
    """
    if U_OR.dtype != torch.bfloat16 or U_OR.dim() != 2:
        raise ValueError(f"expected a 2-D bf16 factor, got {U_OR.dtype} {tuple(U_OR.shape)}")
    return _check_factor(U_OR)


@torch.no_grad()
def check_factors(factors: Sequence[torch.Tensor]) -> list[tuple[bool, int]]:
    """``(all entries finite, rows off the exact-sum grid)`` of each bf16 factor ``[n_out_t, r]``.

    The row maxima of ``|U|`` come from the bf16 bit patterns (an int16 max of the magnitude
    bits orders finite values by size and puts inf/NaN above them), so the finiteness check is
    free. The common case (every row on the grid, none tiny, ``q_i <= 2^16``) is settled by one
    flat test: ``x = U/q`` row by row (``q_i`` a power of two) is then exact or fractional, so
    the rows are on the grid iff every ``x`` is an integer. Otherwise the
    definition ``round(U/q)·q == U`` (a row below ``2^-100`` must be zero) is evaluated row by
    row, as :func:`off_grid_rows` always did. The off-grid count of a non-finite factor is 0.
    """
    for U in factors:
        if U.dtype != torch.bfloat16 or U.dim() != 2:
            raise ValueError(f"expected a 2-D bf16 factor, got {U.dtype} {tuple(U.shape)}")
    # Rows are checked independently: consecutive small factors of one rank and device are checked
    # together (few ops for the many small factors of a delta), in batches of at most _BATCH_ELEMS
    # elements so the temporaries stay cache-sized; a batch that fails is looked at factor by factor.
    out: list[tuple[bool, int]] = [(True, 0)] * len(factors)

    def flush(idx: list[int]) -> None:
        if len(idx) > 1 and _check_factor(torch.cat([factors[i] for i in idx])) == (True, 0):
            return
        for i in idx:
            out[i] = _check_factor(factors[i])

    batch: list[int] = []
    size = 0
    for i, U in enumerate(factors):
        if not U.numel():
            continue
        if batch and (size + U.numel() > _BATCH_ELEMS or (U.shape[1], U.device) != (factors[batch[0]].shape[1],
                                                                                       factors[batch[0]].device)):
            flush(batch)
            batch, size = [], 0
        batch.append(i)
        size += U.numel()
    if batch:
        flush(batch)
    return out


def _check_factor(U_OR: torch.Tensor) -> tuple[bool, int]:
    if U_OR.numel() == 0:
        return True, 0
    mag_O1 = (U_OR.view(torch.int16) & 0x7FFF).amax(dim=1, keepdim=True)
    if bool((mag_O1 >= 0x7F80).any()):
        return False, 0
    q_O1, tiny_O1 = _row_grid_of(mag_O1.view(torch.bfloat16).float(), U_OR.shape[1])
    # x = U/q is exact unless it underflows; with q <= 2^16 a nonzero bf16 U (>= 2^-133) cannot
    # underflow to zero, and an inexact (subnormal) quotient is below 1, hence fractional.
    if not bool(tiny_O1.any()) and float(q_O1.max()) <= 2.0**16:
        if not bool(U_OR.float().div_(q_O1).frac_().any()):
            return True, 0
    U32 = U_OR.float()
    on = torch.where(tiny_O1, U32 == 0, torch.round(U32 / q_O1) * q_O1 == U32)
    return True, int((~on.all(dim=1)).sum())


def split_projection(A_RI: torch.Tensor, distribution: str) -> tuple[torch.Tensor, Optional[float]]:
    """(matrix the GEMM multiplies, scale applied after it): ``(sign(A), s)`` or ``(A, None)``."""
    A32 = A_RI.to(torch.float32).contiguous()
    if distribution == "gaussian":
        return A32, None
    if distribution != "rademacher":
        raise ValueError(f"unknown distribution {distribution!r}")
    s = rademacher_scale(A32.shape[0])
    if not bool((A32.abs() == s).all()):
        raise ValueError(f"A is not a Rademacher projection of rank {A32.shape[0]} (entries must be ±{s})")
    return torch.sign(A32), s


_SIGN32 = -(1 << 31)  # int32 pattern of the fp32 sign bit
_ONE32 = 0x3F800000  # int32 pattern of fp32 1.0


def rademacher_signs(A_RI: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(sign(A), s)`` of an fp32 Rademacher projection *known* to hold ``±s`` (no check).

    For projections regenerated by :func:`megatron_logra.sketch.random_projection.projection`:
    copies each entry's sign bit onto 1.0 (two integer ops) instead of testing every entry
    (use :func:`split_projection` for a projection of unknown origin). A stack ``[P, r, n]`` of
    projections of one rank works the same.
    """
    if A_RI.dtype != torch.float32:
        raise ValueError(f"expected an fp32 projection, got {A_RI.dtype}")
    M_RI = A_RI.contiguous().view(torch.int32) & _SIGN32
    M_RI |= _ONE32
    return M_RI.view(torch.float32), rademacher_scale(A_RI.shape[-2])
