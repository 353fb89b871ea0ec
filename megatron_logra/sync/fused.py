"""The fused merge kernel (``W ← W − V·B`` in one BLAS call) and the check that it rounds once.

The merge subtracts an exact product ``P = V·B`` (``V`` on the exact-sum grid, ``B`` = ±1; see
:mod:`megatron_logra.sync.apply`) from the weight with one fp32 rounding: ``W ⊖ P``. Computing
``P`` into a workspace and subtracting it streams the weight once more than needed; the BLAS call
``W.addmm_(V, B, alpha=-1)`` reads and writes the weight once, inside the GEMM, which on a CPU is
what brings the apply of a delta close to a plain copy of the weights.

Whether ``addmm_`` equals ``W ⊖ P`` bit for bit is up to the BLAS: a kernel that sums all of
``V_ik·B_kj`` before touching ``W`` rounds once, as required; one that starts its accumulators
from ``W`` (MKL does for tiny matrices) or splits the inner dimension and adds each block's partial
sum into ``W`` (MKL does for ranks of 256 and more) rounds several times and gives other bits.
So the fused kernel is used only where it was *measured* to round once: :func:`fused_merge_ok`
runs both kernels on adversarial inputs of the real shape on the weight's device (once per device,
shape, rank, thread count and process) and answers whether they agree. Where they do not, or on
devices other than CPUs and CUDA GPUs, the merge falls back to the two-kernel form, which is exact by
construction. Either way the bits are those of ``W ⊖ P``, so trainer and engine stay bitwise equal
whichever kernel each of them runs. On a GPU the two-kernel form writes ``P`` and reads it back:
twice the memory traffic of the fused call for an fp32 weight (cuBLAS's epilogue ``α·acc + β·C``
with the exact ``acc`` rounds once, which the check confirms per shape).
Imports only torch.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import torch

from megatron_logra.sync.precision import ieee_fp32

logger = logging.getLogger(__name__)

__all__ = ["fused_merge_ok", "fused_enabled", "agrees", "FUSED_ENV", "MAX_CHECK_ELEMS", "MIN_SIDE"]

FUSED_ENV = "MEGATRON_LOGRA_FUSED_MERGE"
"""Environment switch: ``0`` turns the fused kernel off (every merge takes the two-kernel form)."""

MAX_CHECK_ELEMS = 1 << 22
"""Largest check block: bigger weights are checked on a row block of at least this many elements."""

MIN_SIDE = 16
"""Smaller blocks (either side) always take the two-kernel form: fusing them saves nothing, and tiny
GEMMs are where BLAS libraries take their special paths."""

MIN_CHECKED = 1 << 16
"""Entries the random pattern covers at least (several draws for a small block), up to :data:`MAX_DRAWS`."""

MAX_DRAWS = 16

_lock = threading.Lock()
_verdicts: dict[tuple[int, int, int, tuple], bool] = {}


def fused_enabled() -> bool:
    """Whether the fused kernel is allowed (the :data:`FUSED_ENV` switch); each shape is still checked."""
    return os.environ.get(FUSED_ENV, "1").strip() not in ("0", "false", "no", "off")


def _inputs(n_out: int, n_in: int, rank: int, pattern: int, draw: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W, V, B) that expose a second rounding: sums of V·B far below W's spacing, on an exact grid.

    Pattern 0: ``W = 1``, ``V = 2^-26``, ``B = 1``: each product alone is below half of W's spacing
    (a kernel that accumulates into W loses every one), their sum is not. Pattern 1: ``W`` near 1 on
    the fp32 grid, ``V`` random multiples of ``2^-40`` below ``2^(-16-L)`` (``L = ceil(log2 r)``: every
    partial sum stays exact), ``B`` random signs: any partial sum added to ``W`` before the whole sum
    is formed rounds differently somewhere. Pattern 2: subnormal ``W`` (multiples of ``2^-149``) with
    ``V = 0`` on even rows, which must come back unchanged (a kernel that treats subnormals as zero
    returns 0), and ``V`` of pattern 1 scaled to ``2^-100`` on odd rows.
    """
    if pattern == 2:
        gen = torch.Generator().manual_seed(n_out * 1_000_003 + n_in * 1009 + rank * 31 + draw + 2)
        W = torch.randint(-(1 << 20), 1 << 20, (n_out, n_in), generator=gen).float() * 2.0**-149
        bound = 2 ** max(1, 24 - max(0, (rank - 1).bit_length()))
        V = torch.randint(-bound + 1, bound, (n_out, rank), generator=gen).float() * 2.0 ** -(100 + 24)
        V[0::2] = 0.0
        B = torch.randint(0, 2, (rank, n_in), generator=gen).float() * 2 - 1
        return W, V, B
    if pattern == 0:
        return (torch.ones(n_out, n_in), torch.full((n_out, rank), 2.0**-26), torch.ones(rank, n_in))
    gen = torch.Generator().manual_seed(n_out * 1_000_003 + n_in * 1009 + rank * 31 + draw)
    W = 1.0 + torch.randint(-1024, 1024, (n_out, n_in), generator=gen).float() * 2.0**-23
    bound = 2 ** max(1, 24 - max(0, (rank - 1).bit_length()))
    V = torch.randint(-bound + 1, bound, (n_out, rank), generator=gen).float() * 2.0**-40
    B = torch.randint(0, 2, (rank, n_in), generator=gen).float() * 2 - 1
    return W, V, B


def _addmm_kernel(W: torch.Tensor, V: torch.Tensor, B: torch.Tensor) -> None:
    W.addmm_(V, B, alpha=-1)


def agrees(n_out: int, n_in: int, rank: int,
           kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] = _addmm_kernel,
           device: torch.device = torch.device("cpu")) -> bool:
    """Whether ``kernel(W, V, B)`` (in place: ``W ← W − V·B``) on ``device`` gives ``W ⊖ V·B`` on the three
    patterns, the random one over at least :data:`MIN_CHECKED` entries (several draws for a small block: a
    second rounding changes a given entry only some of the time). Inputs and the float64 reference are
    made on the CPU."""
    draws = -(-MIN_CHECKED // (n_out * n_in))
    for draw, pattern in enumerate([0, 2] + [1] * min(draws, MAX_DRAWS)):
        W, V, B = _inputs(n_out, n_in, rank, pattern, draw)
        expect = (W.double() - V.double() @ B.double()).float()  # P is exact (grid): one rounding, W ⊖ P
        W, V, B = W.to(device), V.to(device), B.to(device)
        kernel(W, V, B)
        if not torch.equal(W.cpu(), expect):
            return False
    return True


def fused_merge_ok(device: torch.device, n_out: int, n_in: int, rank: int) -> bool:
    """Whether ``W.addmm_(V, B, alpha=-1)`` on an ``[n_out, n_in]`` fp32 block equals ``W ⊖ V·B`` on ``device``.

    CPUs and CUDA GPUs (other devices: False). The answer is measured once per (device, shape, rank,
    thread count) and remembered; a block larger than :data:`MAX_CHECK_ELEMS` is checked on a row block
    of that size (the BLAS takes the same path for every large block). Allocates a few blocks of the
    checked size: call it before the first write of an all-or-nothing apply.
    """
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        where: tuple = ("cuda", device.index)
    elif device.type == "cpu":
        where = ("cpu", torch.get_num_threads())
    else:
        return False
    if not fused_enabled() or n_out < MIN_SIDE or n_in < MIN_SIDE or rank == 0:
        return False
    rows = n_out if n_out * n_in <= MAX_CHECK_ELEMS else max(256, MAX_CHECK_ELEMS // n_in)
    key = (min(rows, n_out), n_in, rank, where)
    verdict = _verdicts.get(key)  # a dict read is atomic: the lock only orders the first measurement
    if verdict is not None:
        return verdict
    with _lock:
        verdict = _verdicts.get(key)
        if verdict is None:
            with torch.no_grad(), ieee_fp32():  # as the merge runs it
                verdict = agrees(key[0], n_in, rank, device=device)
            _verdicts[key] = verdict
            if not verdict:
                logger.info("fused merge off for [%d, %d] blocks at rank %d (%s): the BLAS rounds twice",
                            key[0], n_in, rank, where)
    return verdict
