"""Counter-based random projections.

Every entry ``A[k, j]`` of a projection is a pure function of
``(seed, canonical layer name, update index, row k, column j)``. There is no generator
state: a tensor-parallel rank that owns columns ``cols`` of a row-parallel layer, an
inference engine with another TP degree, or a GPU process all compute exactly the same
numbers for the entries they ask for, without materialising the whole matrix.

The hash is a 32-bit integer mixer (``lowbias32``) evaluated with int64 torch ops whose
intermediate values never exceed 2**63, so the result is identical on every backend. On the
CPU the per-entry part runs on int32 bit patterns instead (two's-complement wrapping add and
multiply are arithmetic mod 2**32, shifts are masked to be logical): the same integers, a
third of the memory traffic and no emulated 64-bit multiplies; tests compare both paths and
a plain-Python reference bitwise.

The hash itself (``projection_key``, ``hash_u32``, the int32 ``entry_hash_*`` pre-hashes and
blocks) lives in :mod:`megatron_logra.sketch.entry_hash` and is re-exported here; this module
builds projections from it: :func:`projection` (Rademacher or Gaussian, any columns),
:func:`rademacher_projections` (many layers of one width in one batch) and
:func:`shared_projections` (one tensor per equal call within a block).

This module imports only ``torch`` and the standard library (and the torch-only
:mod:`~megatron_logra.sketch.naming` and :mod:`~megatron_logra.sketch.entry_hash`): inference
engines import it in processes that have no megatron-core.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import struct
from typing import Iterator, Optional, Sequence, Union

import torch

from megatron_logra.sketch.entry_hash import (  # noqa: F401  (re-exported: hash_u32, _hash_i32_, _entry_hash, ...)
    _GOLDEN,
    _MASK32,
    _entry_hash,
    _entry_hash_i32,
    _hash_i32_,
    _i32,
    entry_hash_block_,
    entry_hash_parts,
    entry_hash_parts_many,
    hash_u32,
    projection_key,
)
from megatron_logra.sketch.naming import canonical_name

__all__ = ["DISTRIBUTIONS", "projection", "rademacher_projections", "projection_key", "hash_u32", "shared_projections",
           "entry_hash_parts", "entry_hash_parts_many", "entry_hash_block_"]

DISTRIBUTIONS = ("rademacher", "gaussian")

_SIGN32 = -(1 << 31)  # int32 pattern of bit 31


def _f32_bits(x: float) -> int:
    """int32 bit pattern of ``fp32(x)`` (round to nearest even, as torch rounds a Python float)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _fast_path(device: torch.device) -> bool:
    """Whether the int32 path runs on ``device`` (CPU and CUDA, where int32 arithmetic wraps modulo 2**32;
    elsewhere the int64 ops, bitwise equal): a quarter of the kernel launches, which dominate on a GPU."""
    return device.type in ("cpu", "cuda")


_MEMO: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("logra_projection_memo", default=None)


@contextlib.contextmanager
def shared_projections() -> Iterator[None]:
    """Within the block, :func:`projection` calls with equal arguments return one tensor, computed once.

    For a consumer that needs one layer's projection for several of its parameters in one
    update (an engine's ``q``/``k``/``v`` or ``gate``/``up`` weights): the tensors returned
    inside the block are shared and must be treated as read-only. Calls with an index list
    or tensor as ``cols`` are not shared. Nothing is kept after the block (nested blocks share
    the outer one's memo).
    """
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def _memo_key(
    seed: int, name: str, update: int, rank: int, n_in: int, distribution: str,
    cols: Optional[Union[Sequence[int], torch.Tensor, slice, range]], device: Optional[Union[str, torch.device]],
) -> Optional[tuple]:
    """Hashable key of a :func:`projection` call, or None when ``cols`` is an index list or tensor (not shared)."""
    if cols is None:
        cols_key: Optional[tuple] = None
    elif isinstance(cols, range):
        cols_key = ("range", cols.start, cols.stop, cols.step)
    elif isinstance(cols, slice):
        cols_key = ("slice", cols.start, cols.stop, cols.step)
    else:
        return None
    dev = None if device is None else str(torch.device(device))
    return (int(seed), canonical_name(name), int(update), int(rank), int(n_in), distribution, cols_key, dev)


def projection(
    seed: int,
    name: str,
    update: int,
    rank: int,
    n_in: int,
    *,
    distribution: str = "rademacher",
    cols: Optional[Union[Sequence[int], torch.Tensor, slice, range]] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """Projection ``A`` (or the columns ``cols`` of it) as fp32 ``[rank, len(cols)]``.

    Args:
        seed: base seed of the run.
        name: layer name; canonicalised, so Megatron, HF and wrapped names of one layer agree.
        update: 0-based update index (optimizer step ``t`` uses ``t - 1``).
        rank: number of rows ``r``.
        n_in: number of input features of the full (unsharded) layer.
        distribution: ``"rademacher"`` (entries ±1/√r, exact on every device) or
            ``"gaussian"`` (N(0, 1/r) by Box–Muller in float64, rounded to fp32).
        cols: global column indices to produce (default: all ``n_in``).
        device: where to build the result.

    ``E[AᵀA] = I`` for both distributions. Inside :func:`shared_projections` equal calls
    return the same (read-only) tensor.
    """
    memo = _MEMO.get()
    mkey = None if memo is None else _memo_key(seed, name, update, rank, n_in, distribution, cols, device)
    if memo is None or mkey is None:
        return _projection(seed, name, update, rank, n_in, distribution=distribution, cols=cols, device=device)
    hit = memo.get(mkey)
    if hit is None:
        hit = _projection(seed, name, update, rank, n_in, distribution=distribution, cols=cols, device=device)
        memo[mkey] = hit
    return hit


def rademacher_projections(
    seed: int,
    names: Sequence[str],
    update: int,
    rank: int,
    n_in: int,
    *,
    cols: Optional[range] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """``torch.stack([projection(seed, n, update, rank, n_in, cols=cols, device=device) for n in names])``,
    Rademacher, ``[len(names), rank, len(cols)]``, bitwise equal to it, in one batch of elementwise ops.

    For a consumer that regenerates many layers' projections of one width at once (an engine applying
    a sketch delta): on a GPU the per-call kernel launches, not the arithmetic, are the cost.
    ``cols`` is a contiguous range of ``[0, n_in)`` (a row-parallel shard) or None for all columns.
    """
    span = range(n_in) if cols is None else cols
    fast = _fast_path(torch.device(device) if device is not None else torch.device("cpu"))
    if (not names or rank < 1 or n_in < 1 or span.step != 1 or (len(span) and (span.start < 0 or span[-1] >= n_in))
            or not fast or n_in >= 1 << 31 or rank >= 1 << 31):
        return torch.stack([projection(seed, n, update, rank, n_in, cols=cols, device=device) for n in names])
    keys = torch.tensor([[_i32(k) for k in projection_key(seed, n, update)] for n in names],
                        dtype=torch.int32, device=device)  # [P, 4]
    num_rows = rank
    rc = torch.cat([torch.arange(rank, dtype=torch.int32, device=device),
                    torch.arange(span.start, span.start + len(span), dtype=torch.int32, device=device)])
    rc = rc.expand(len(names), -1).clone()  # [P, R + C], as entry_hash_parts builds it per key
    tmp = torch.empty_like(rc)
    rc[:, :num_rows] ^= keys[:, 0:1]
    rc[:, num_rows:] ^= keys[:, 2:3]
    _hash_i32_(rc, tmp)
    rc[:, :num_rows] ^= keys[:, 1:2]  # lane 0: no salt
    rc[:, num_rows:] ^= keys[:, 3:4]
    _hash_i32_(rc, tmp)
    row_h, col_g = rc[:, :num_rows], rc[:, num_rows:]
    col_g.mul_(_i32(_GOLDEN))
    out = torch.empty(len(names), num_rows, len(span), dtype=torch.int32, device=rc.device)
    h = entry_hash_block_(out, row_h, col_g, 0, torch.empty_like(out), sign_only=True)
    h &= _SIGN32
    h |= _f32_bits(1.0 / math.sqrt(rank))
    return h.view(torch.float32)


def _projection(
    seed: int,
    name: str,
    update: int,
    rank: int,
    n_in: int,
    *,
    distribution: str = "rademacher",
    cols: Optional[Union[Sequence[int], torch.Tensor, slice, range]] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """:func:`projection` without the memo."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if n_in < 1:
        raise ValueError(f"n_in must be >= 1, got {n_in}")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; choose one of {DISTRIBUTIONS}")
    in_range = False  # whether col_idx is known to lie in [0, n_in) without looking at it
    if cols is None:
        col_idx = torch.arange(n_in, dtype=torch.int64, device=device)
        in_range = True
    elif isinstance(cols, (slice, range)):
        span = range(n_in)[cols] if isinstance(cols, slice) else cols
        if span.step == 1 and (len(span) == 0 or (span.start >= 0 and span[-1] < n_in)):
            col_idx = torch.arange(span.start, span.start + len(span), dtype=torch.int64, device=device)
            in_range = True
        else:
            col_idx = torch.as_tensor(list(span), dtype=torch.int64, device=device)
    else:
        col_idx = torch.as_tensor(cols, dtype=torch.int64, device=device)
        if col_idx.dim() != 1:
            raise ValueError(f"cols must be one-dimensional, got shape {tuple(col_idx.shape)}")
    if not in_range and col_idx.numel() and (int(col_idx.min()) < 0 or int(col_idx.max()) >= n_in):
        raise ValueError(f"cols must lie in [0, {n_in}); got range [{int(col_idx.min())}, {int(col_idx.max())}]")
    row_idx = torch.arange(rank, dtype=torch.int64, device=col_idx.device)
    key = projection_key(seed, name, update)
    scale = 1.0 / math.sqrt(rank)
    fast = _fast_path(col_idx.device) and n_in < 1 << 31 and rank < 1 << 31
    if distribution == "rademacher":
        if fast:  # bit 31 of the hash is the sign bit of ±fp32(scale): build the floats' bit patterns
            h = _entry_hash_i32(key, row_idx, col_idx, 0, sign_only=True)
            h &= _SIGN32
            h |= _f32_bits(scale)
            return h.view(torch.float32)
        bits = _entry_hash(key, row_idx, col_idx, lane=0) >> 31
        out = (1.0 - 2.0 * bits.to(torch.float32)) * scale
        return out
    if fast:
        h1 = (_entry_hash_i32(key, row_idx, col_idx, 1).to(torch.int64) & _MASK32).to(torch.float64)
        h2 = (_entry_hash_i32(key, row_idx, col_idx, 2).to(torch.int64) & _MASK32).to(torch.float64)
    else:
        h1 = _entry_hash(key, row_idx, col_idx, lane=1).to(torch.float64)
        h2 = _entry_hash(key, row_idx, col_idx, lane=2).to(torch.float64)
    u1 = (h1 + 1.0) / 4294967296.0  # (0, 1]
    u2 = h2 / 4294967296.0  # [0, 1)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return (z * scale).to(torch.float32)
