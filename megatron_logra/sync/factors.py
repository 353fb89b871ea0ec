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

import logging
import math
from typing import Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["rademacher_scale", "quantize_factor", "off_grid_rows", "split_projection"]

_TINY_ROW_EXP = -100


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
    U32 = U_OR.float()
    q, tiny = _row_grid(U32)
    on = torch.where(tiny, U32 == 0, torch.round(U32 / q) * q == U32)
    return int((~on.all(dim=1)).sum())


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
