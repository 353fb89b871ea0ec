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
    "rademacher_signs",
]

_TINY_ROW_EXP = -100


@functools.lru_cache(maxsize=64)
def rademacher_scale(rank: int) -> float:
    """``s = fp32(1/sqrt(r))``: the magnitude of every entry of a Rademacher projection."""
    return float(torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32))


def _row_grid(U32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid ``q`` ``[n_out, 1]``, tiny-row mask ``[n_out, 1]``) of fp32 factors ``U32`` ``[n_out, r]``."""
    L = max(0, math.ceil(math.log2(U32.shape[1])))
    rowmax = U32.abs().amax(dim=1, keepdim=True)
    _, e = torch.frexp(rowmax)
    tiny = rowmax < 2.0**_TINY_ROW_EXP
    q = torch.ldexp(torch.ones_like(rowmax), torch.clamp(e + (L - 24), min=-149))
    return q, tiny


@torch.no_grad()
def quantize_factor(X_OR: torch.Tensor) -> torch.Tensor:
    """bf16 factor ``U`` of an fp32 ``α·D`` ``[n_out, r]`` on the exact-sum grid (module docstring)."""
    U32 = X_OR.to(torch.bfloat16).float()
    q, tiny = _row_grid(U32)
    U32 = torch.where(tiny, torch.zeros_like(U32), torch.round(U32 / q) * q)
    return U32.to(torch.bfloat16)


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
    return check_factors([U_OR])[0]


@torch.no_grad()
def check_factors(factors: Sequence[torch.Tensor]) -> list[tuple[bool, int]]:
    """``(all entries finite, rows off the exact-sum grid)`` of each bf16 factor ``[n_out_t, r]`` (one ``r``).

    All factors are checked in one batch of row-wise ops (their rows concatenated). The row
    maxima of ``|U|`` come from the bf16 bit patterns (an int16 max of the magnitude bits
    orders finite values by size and puts inf/NaN above them), so the finiteness check is
    free. A row is on the grid iff every ``U_ik / q_i`` (exact: ``q_i`` is a power of two) is
    an integer, which is what :func:`quantize_factor` produces and ``round(U/q)·q == U``
    tests; a row below ``2^-100`` must be zero. The off-grid count of a factor that is not
    finite is reported as 0.
    """
    if not factors:
        return []
    r = factors[0].shape[-1]
    for U in factors:
        if U.dtype != torch.bfloat16 or U.dim() != 2 or U.shape[1] != r:
            raise ValueError(f"expected 2-D bf16 factors with {r} columns, got {U.dtype} {tuple(U.shape)}")
    U_NR = factors[0] if len(factors) == 1 else torch.cat(list(factors))
    if U_NR.numel() == 0:
        return [(True, 0) for _ in factors]
    mag_N1 = (U_NR.view(torch.int16) & 0x7FFF).amax(dim=1, keepdim=True)
    rowmax_N1 = mag_N1.view(torch.bfloat16).float()  # NaN/inf rows: >= 0x7F80
    L = max(0, math.ceil(math.log2(r)))
    _, e = torch.frexp(rowmax_N1)
    tiny_N1 = rowmax_N1 < 2.0**_TINY_ROW_EXP
    q_N1 = torch.ldexp(torch.ones_like(rowmax_N1), torch.clamp(e + (L - 24), min=-149))
    frac_NR = torch.frac(U_NR.float().div_(q_N1))
    nonfinite_N = (mag_N1[:, 0] >= 0x7F80).to(torch.int32)
    off_N = frac_NR.ne_(0).any(dim=1, keepdim=True)
    off_N = torch.where(tiny_N1, rowmax_N1 != 0, off_N)[:, 0].to(torch.int32)
    ends = torch.tensor([U.shape[0] for U in factors]).cumsum(0)
    starts = ends - torch.tensor([U.shape[0] for U in factors])
    cs = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), nonfinite_N.cumsum(0)]),
                      torch.cat([torch.zeros(1, dtype=torch.int64), off_N.cumsum(0)])])  # [2, N + 1]
    counts = (cs[:, ends] - cs[:, starts]).tolist()
    return [(nf == 0, off if nf == 0 else 0) for nf, off in zip(counts[0], counts[1])]


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
    (use :func:`split_projection` for a projection of unknown origin).
    """
    if A_RI.dtype != torch.float32:
        raise ValueError(f"expected an fp32 projection, got {A_RI.dtype}")
    M_RI = A_RI.contiguous().view(torch.int32) & _SIGN32
    M_RI |= _ONE32
    return M_RI.view(torch.float32), rademacher_scale(A_RI.shape[0])
