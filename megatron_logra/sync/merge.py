"""The merge arithmetic the trainer and every engine share: ``W ← decay·W − U·A``, bit for bit.

**Factors.** ``U = quantize_factor(α·D)``: round to bf16 (nearest even), then round each row
onto the grid ``q_i = 2^(e_i + L − 24)`` where ``2^(e_i−1) <= max_k |U_ik| < 2^e_i`` and
``L = ceil(log2 r)`` (rows whose max is below ``2^-100`` become zero). Entries of at least
``2^-(15−L)``·rowmax keep their bf16 value; smaller ones move by at most ``2^-(24−L)``·rowmax,
far below bf16's own rounding of the large entries (see :mod:`megatron_logra.sync.factors`). On that grid every partial sum of ``±U_ik`` is an
integer multiple of ``q_i`` below ``2^24·q_i``: exactly representable in fp32.

**Merge** ``low_rank_merge_(W, U_OR, A_RI, decay, distribution)``::

    rademacher (A = s·B, B = ±1, s = fp32(1/sqrt(r))):
        V = grid(s ⊙ U)             # scaled_factor: one fp32 product per entry, rows back on the exact-sum grid
        P = mm_fp32(V, B)           # exact (any order, any blocking; IEEE fp32: never TF32 or bf16)
    gaussian:
        V = U, P = mm_fp32(U, A)    # ordinary fp32 GEMM (bits depend on the kernel)
    fp32 W:       W = (decay ⊙ W) ⊖ P                         (in place)
    bf16/fp16 W:  W = round_nearest_even((decay ⊙ fp32(W)) ⊖ P)
    bf16 W, ``rounding="stochastic"``:  W = round_stochastic((decay ⊙ fp32(W)) ⊖ P, noise)

Since ``P`` is exact, ``⊖ P`` is a single rounding however it is computed: on a CPU one BLAS call
``W.addmm_(V, B, alpha=-1)`` does the GEMM and the subtraction in one pass over the weight, where
:func:`megatron_logra.sync.fused.fused_merge_ok` measured that the BLAS rounds once for that shape;
elsewhere ``P`` goes into a row-chunk workspace and is subtracted (same bits).

**Stochastic rounding** (``rounding="stochastic"``): bf16 weights only, with the noise ``ρ_i XOR γ_j`` of
:mod:`megatron_logra.sync.rounding_noise` (:class:`StochasticRounding`), the same for every TP degree and engine
layout. fp16 weights are rounded to nearest either way.

``⊙``/``⊖`` are single correctly-rounded fp32 operations; ``decay ⊙`` is skipped when
``decay == 1``. With Rademacher projections (the default) the result is therefore the same
bits for any split of U's rows or A's columns over tensor-parallel ranks, any chunking, any
BLAS and any device: trainer and engine weights stay bitwise equal. With Gaussian projections
that holds only where both sides run the same GEMM shapes on the same kind of device. Both merge
entry points run in IEEE fp32 whatever matmul precision or denormal mode the process chose (TF32 or bf16
would round ``V`` inside the GEMM, flushing would zero subnormal weights; :mod:`megatron_logra.sync.precision`).
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from megatron_logra.sync.factors import scaled_factor, split_projection
from megatron_logra.sync.fused import fused_merge_ok
from megatron_logra.sync.precision import ieee_fp32
from megatron_logra.sync.rounding_noise import ROUNDING_LANE, StochasticRounding, noise_parts, rounding_key, shard_rows

logger = logging.getLogger(__name__)

__all__ = [
    "low_rank_merge_", "merge_row_chunks", "chunk_elems", "MERGE_DTYPES", "StochasticRounding", "noise_parts",
    "shard_rows", "rounding_key", "ROUNDING_LANE",
]

MERGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_CHUNK_ROWS = 16
DEFAULT_CHUNK_ELEMS = 1 << 22
_CPU_CHUNK_ELEMS_PER_THREAD = 1 << 17
"""CPU merge chunk per thread: 512 KiB of fp32 scratch (plus its weight rows and noise) stays in each
core's L2, where the scratch passes of a 16-bit weight run (measured: 2^17 per thread beats 2^20 by
10-25%, smaller chunks lose to dispatch)."""
_CPU_CHUNK_ELEMS_MAX = 1 << 20


def chunk_elems(device: torch.device, requested: Optional[int] = None) -> int:
    """Merge chunk size in elements: ``requested``, else L2-sized per thread on CPU (up to 2^20) and 2^22 elsewhere
    (fewer launches)."""
    if requested is not None:
        return requested
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind != "cpu":
        return DEFAULT_CHUNK_ELEMS
    return min(_CPU_CHUNK_ELEMS_MAX, _CPU_CHUNK_ELEMS_PER_THREAD * max(1, torch.get_num_threads()))


def merge_row_chunks(n_out: int, n_in: int, max_chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> list[tuple[int, int]]:
    """Row chunks ``[(start, stop)]`` of a merge: ``>= MIN_CHUNK_ROWS`` rows each unless ``n_out`` is smaller
    (a short tail is folded into the previous chunk)."""
    per = max(MIN_CHUNK_ROWS, max_chunk_elems // max(n_in, 1))
    chunks = [(s, min(n_out, s + per)) for s in range(0, n_out, per)]
    if len(chunks) > 1 and chunks[-1][1] - chunks[-1][0] < MIN_CHUNK_ROWS:
        tail = chunks.pop()
        chunks[-1] = (chunks[-1][0], tail[1])
    return chunks


def _workspace_elems(n_out: int, n_in: int, max_chunk_elems: int) -> int:
    return max(b - a for a, b in merge_row_chunks(n_out, n_in, max_chunk_elems)) * n_in if n_out else 0


_Noise = tuple[torch.Tensor, torch.Tensor]
"""Row hashes ``[n_out]`` and column hashes ``[n_in]`` (16-bit) of a weight's rounding noise."""


def _merge_prepared_(
    weight: torch.Tensor,
    V32_OR: torch.Tensor,
    M_RI: torch.Tensor,
    decay: Union[float, torch.Tensor],
    prod_buf: torch.Tensor,
    tmp_buf: torch.Tensor,
    max_chunk_elems: int,
    noise: Optional[_Noise] = None,
    noise_buf: Optional[torch.Tensor] = None,
    fused: bool = False,
) -> None:
    """The commit kernel: in-place ops into preallocated buffers only.

    ``decay``: 1.0 (skipped), another float, or a 0-d fp32 tensor on the weight's device holding it (the
    same product; what a replayed CUDA graph reads, :mod:`megatron_logra.sync.graph`).
    ``fused`` (only where :func:`megatron_logra.sync.fused.fused_merge_ok` holds for every block):
    an fp32 weight takes ``W.addmm_(V, M, alpha=-1)`` whole, a 16-bit weight's fp32 scratch chunk
    likewise, and ``prod_buf`` is not used. Otherwise, per row chunk: ``P = V·M`` (GEMM into
    ``prod_buf``) and ``W ⊖ P``. A bf16/fp16 weight goes through the fp32 scratch ``tmp_buf``
    (three vectorised passes in cache are faster than one mixed-dtype op, which torch runs through
    a per-element cast). With ``noise`` (bf16 only) the chunk's noise ``ρ_i XOR γ_j`` is formed in
    the int32 ``noise_buf`` (one chunk), added to the fp32 bit pattern, and the 16 bits bf16 drops
    are cut.
    """
    n_in = weight.shape[1]
    scaled = isinstance(decay, torch.Tensor) or decay != 1.0  # a 0-d fp32 tensor: the same product, no sync
    if weight.dtype == torch.float32 and fused:
        if scaled:
            weight.mul_(decay)
        weight.addmm_(V32_OR, M_RI, alpha=-1)
        return
    for start, stop in merge_row_chunks(weight.shape[0], n_in, max_chunk_elems):
        rows = stop - start
        block = weight[start:stop]
        if weight.dtype == torch.float32:
            prod = prod_buf[: rows * n_in].view(rows, n_in)
            torch.mm(V32_OR[start:stop], M_RI, out=prod)
            if scaled:
                block.mul_(decay)
            block.sub_(prod)
            continue
        tmp = tmp_buf[: rows * n_in].view(rows, n_in)
        tmp.copy_(block)
        if scaled:
            tmp.mul_(decay)
        if fused:
            tmp.addmm_(V32_OR[start:stop], M_RI, alpha=-1)
        else:
            prod = prod_buf[: rows * n_in].view(rows, n_in)
            torch.mm(V32_OR[start:stop], M_RI, out=prod)
            tmp.sub_(prod)
        if noise is not None:
            row_bits, col_bits = noise
            bits = noise_buf[: rows * n_in].view(rows, n_in)
            torch.bitwise_xor(row_bits[start:stop].unsqueeze(1), col_bits.unsqueeze(0), out=bits)
            pattern = tmp.view(torch.int32)
            pattern += bits  # sign-magnitude: the magnitude's dropped bits round up with their probability
            pattern &= -65536  # what bf16 keeps: the conversion below is exact
        block.copy_(tmp)


def _fused(weight: torch.Tensor, rank: int, distribution: str, max_chunk_elems: int) -> bool:
    """Whether the merge of ``weight`` may take the fused kernel: Rademacher (``P`` exact) and every
    block it would run (the whole fp32 weight, or each scratch chunk) measured to round once."""
    if distribution != "rademacher":
        return False
    n_out, n_in = weight.shape
    if weight.dtype == torch.float32:
        blocks = {n_out}
    else:
        blocks = {b - a for a, b in merge_row_chunks(n_out, n_in, max_chunk_elems)}
    return all(fused_merge_ok(weight.device, rows, n_in, rank) for rows in blocks)


def _workspaces_elems(weight: torch.Tensor, fused: bool, stochastic: bool, max_chunk_elems: int
                      ) -> tuple[int, int, int]:
    """(product, fp32 scratch, int32 noise) elements one weight's merge needs."""
    fp32 = weight.dtype == torch.float32
    if fp32 and fused:
        return (0, 0, 0)  # one addmm_ on the weight itself
    elems = _workspace_elems(weight.shape[0], weight.shape[1], max_chunk_elems)
    return (0 if fused else elems, 0 if fp32 else elems, elems if stochastic else 0)


@torch.no_grad()
@ieee_fp32()
def low_rank_merge_(
    weight: torch.Tensor,
    U_OR: torch.Tensor,
    A_RI: torch.Tensor,
    *,
    decay: float = 1.0,
    distribution: str = "rademacher",
    max_chunk_elems: Optional[int] = None,
    rounding: Optional[StochasticRounding] = None,
) -> None:
    """``W ← decay·W − U·A`` in place, exactly as the module docstring defines it.

    Args:
        weight: ``[n_out, n_in_local]`` fp32, bf16 or fp16.
        U_OR: ``[n_out, r]`` factors (bf16 from :func:`quantize_factor` for the exactness guarantee).
        A_RI: ``[r, n_in_local]``: the columns of the projection this weight multiplies.
        decay: weight-decay factor (1.0: none).
        distribution: ``rademacher`` (A must be ±fp32(1/sqrt(r)); ValueError otherwise) or ``gaussian``.
        max_chunk_elems: elements per row chunk (default: :func:`chunk_elems`: cache-sized on CPU, 2^22 on
            accelerators). Results do not depend on it (Rademacher).
        rounding: round a bf16 ``weight`` stochastically with this noise (None, or another dtype: to nearest).
    """
    if weight.dim() != 2 or U_OR.dim() != 2 or A_RI.dim() != 2:
        raise ValueError(f"expected 2-D tensors, got W {tuple(weight.shape)}, U {tuple(U_OR.shape)}, A {tuple(A_RI.shape)}")
    n_out, n_in = weight.shape
    if U_OR.shape[0] != n_out or A_RI.shape != (U_OR.shape[1], n_in):
        raise ValueError(f"shapes do not chain: W {tuple(weight.shape)}, U {tuple(U_OR.shape)}, A {tuple(A_RI.shape)}")
    if weight.dtype not in MERGE_DTYPES:
        raise ValueError(f"weight dtype {weight.dtype} is not one of {MERGE_DTYPES}")
    M_RI, scale = split_projection(A_RI.to(weight.device), distribution)
    V32 = scaled_factor(U_OR.to(device=weight.device), scale)
    max_chunk_elems = chunk_elems(weight.device, max_chunk_elems)
    stochastic = rounding is not None and weight.dtype == torch.bfloat16
    fused = _fused(weight, U_OR.shape[1], distribution, max_chunk_elems)
    n_prod, n_tmp, n_noise = _workspaces_elems(weight, fused, stochastic, max_chunk_elems)
    prod_buf = torch.empty(n_prod, dtype=torch.float32, device=weight.device)
    tmp_buf = torch.empty(n_tmp, dtype=torch.float32, device=weight.device)
    noise = rounding.parts(n_out, n_in, weight.device) if stochastic else None
    noise_buf = torch.empty(n_noise, dtype=torch.int32, device=weight.device) if stochastic else None
    _merge_prepared_(weight, V32, M_RI, decay, prod_buf, tmp_buf, max_chunk_elems, noise, noise_buf, fused)

