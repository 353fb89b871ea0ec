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

This module imports only ``torch`` and the standard library: inference engines import
it in processes that have no megatron-core.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import struct
from typing import Iterator, Optional, Sequence, Union

import torch

from megatron_logra.sketch.naming import canonical_name

__all__ = ["DISTRIBUTIONS", "projection", "rademacher_projections", "projection_key", "hash_u32", "shared_projections",
           "entry_hash_parts", "entry_hash_parts_many", "entry_hash_block_"]

DISTRIBUTIONS = ("rademacher", "gaussian")

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
# lowbias32 constants (Wellons, "hash-prospector").
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_SIGN32 = -(1 << 31)  # int32 pattern of bit 31


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32) without int64 overflow."""
    lo = x * (c & _MASK16)
    hi = ((x * (c >> 16)) & _MASK16) << 16
    return (lo + hi) & _MASK32


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit mixer (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    x = x ^ (x >> 16)
    return x


def _i32(c: int) -> int:
    """The int32 whose two's-complement bit pattern is the uint32 ``c``."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _xorshift_i32_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    """``x ^= x >>> shift`` (logical shift) in place on int32 bit patterns; ``tmp``: scratch like ``x``."""
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp &= (1 << (32 - shift)) - 1
    x ^= tmp


def _hash_i32_(x: torch.Tensor, tmp: torch.Tensor, *, sign_only: bool = False) -> torch.Tensor:
    """:func:`hash_u32` in place on int32 bit patterns (``tmp``: scratch of ``x``'s shape).

    ``sign_only`` skips the last xorshift, which does not change bit 31: only the sign bit of
    the result is then meaningful.
    """
    _xorshift_i32_(x, 16, tmp)
    x.mul_(_i32(_C1))
    _xorshift_i32_(x, 15, tmp)
    x.mul_(_i32(_C2))
    if not sign_only:
        _xorshift_i32_(x, 16, tmp)
    return x


def projection_key(seed: int, name: str, update: int) -> tuple[int, int, int, int]:
    """Four 32-bit words derived from ``(seed, canonical name, update index)``.

    Uses BLAKE2b, so the key is stable across Python processes, platforms and versions
    (unlike ``hash()``).
    """
    if update < 0:
        raise ValueError(f"update index must be >= 0, got {update}")
    msg = f"logra-projection-v1|{int(seed)}|{canonical_name(name)}|{int(update)}".encode()
    digest = hashlib.blake2b(msg, digest_size=16).digest()
    return tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(4))  # type: ignore[return-value]


def _entry_hash(
    key: tuple[int, int, int, int], rows: torch.Tensor, cols: torch.Tensor, lane: int
) -> torch.Tensor:
    """Hash of every (row, col) pair: [len(rows), len(cols)] int64 in [0, 2**32)."""
    k0, k1, k2, k3 = key
    lane_salt = (lane * _GOLDEN) & _MASK32
    row_h = hash_u32(hash_u32((rows ^ k0) & _MASK32) ^ k1 ^ lane_salt)  # [R]
    col_h = hash_u32(hash_u32((cols ^ k2) & _MASK32) ^ k3)  # [C]
    mixed = hash_u32(((row_h[:, None] + _mul32(col_h, _GOLDEN)[None, :]) & _MASK32) ^ lane_salt)
    return hash_u32(mixed ^ row_h[:, None])


def entry_hash_parts(
    key: tuple[int, int, int, int], rows: torch.Tensor, cols: torch.Tensor, lane: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The per-row and per-column pre-hashes of :func:`_entry_hash_i32` (int32 ``[R]``, ``[C]``) and its
    lane salt: what :func:`entry_hash_block_` combines into any block of entries. Indices must be < 2**31.
    (:func:`entry_hash_parts_many` with one key.)"""
    (row_h,), (col_g,) = entry_hash_parts_many([key], [rows], [cols], lane)
    return row_h, col_g, (lane * _GOLDEN) & _MASK32


def entry_hash_parts_many(
    keys: Sequence[tuple[int, int, int, int]], rows: Sequence[torch.Tensor], cols: Sequence[torch.Tensor], lane: int,
    *, low_bits: Optional[int] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`entry_hash_parts` of several keys at once: the row pre-hashes of each key's ``rows`` and the
    column pre-hashes of its ``cols`` (int32, on the device of ``rows[0]``). They run as one vector whose key
    words are per element: a dozen ops in all rather than a dozen per key, which is what the rounding noise
    of hundreds of weights, or hundreds of small projections, costs in dispatches and kernel launches.
    ``low_bits``: keep only that many low bits of every pre-hash."""
    if not (len(keys) == len(rows) == len(cols)) or not keys:
        raise ValueError(f"expected as many keys, row and column vectors (at least one), got "
                         f"{len(keys)}, {len(rows)}, {len(cols)}")
    lane_salt = (lane * _GOLDEN) & _MASK32
    device = rows[0].device
    sizes = [r.numel() for r in rows] + [c.numel() for c in cols]
    R = sum(sizes[: len(keys)])
    rc = torch.cat([t.to(device=device, dtype=torch.int32) for t in (*rows, *cols)])  # [R + C]
    counts = torch.tensor(sizes, device=device)

    def words(row_words: list[int], col_words: list[int]) -> torch.Tensor:
        """One int32 word per element of ``rc``: each key's word over its rows, then over its columns."""
        w = torch.tensor(row_words + col_words, dtype=torch.int32, device=device)
        return w.repeat_interleave(counts, output_size=rc.numel())

    tmp = torch.empty_like(rc)
    rc ^= words([_i32(k[0]) for k in keys], [_i32(k[2]) for k in keys])
    _hash_i32_(rc, tmp)
    rc ^= words([_i32(k[1] ^ lane_salt) for k in keys], [_i32(k[3]) for k in keys])
    _hash_i32_(rc, tmp)
    rc[R:].mul_(_i32(_GOLDEN))
    if low_bits is not None:
        rc &= (1 << low_bits) - 1
    parts = rc.split(sizes)
    return list(parts[: len(keys)]), list(parts[len(keys) :])


def entry_hash_block_(out: torch.Tensor, row_h: torch.Tensor, col_g: torch.Tensor, lane_salt: int,
                      tmp: torch.Tensor, *, sign_only: bool = False) -> torch.Tensor:
    """``out[i, j]`` = the int32 entry hash of row ``i`` and column ``j`` from :func:`entry_hash_parts`
    (``row_h`` ``[R]``, ``col_g`` ``[C]``), written in place into the int32 buffer ``out`` ``[R, C]`` with
    the scratch ``tmp`` of the same shape: no allocation (the sketch-delta commit relies on it). Batched
    too: ``row_h`` ``[P, R]`` and ``col_g`` ``[P, C]`` of ``P`` keys fill ``out`` ``[P, R, C]``."""
    torch.add(row_h.unsqueeze(-1), col_g.unsqueeze(-2), out=out)  # wraps mod 2**32
    if lane_salt:
        out ^= _i32(lane_salt)
    _hash_i32_(out, tmp)
    out ^= row_h.unsqueeze(-1)
    return _hash_i32_(out, tmp, sign_only=sign_only)


def _entry_hash_i32(
    key: tuple[int, int, int, int], rows: torch.Tensor, cols: torch.Tensor, lane: int, *, sign_only: bool = False
) -> torch.Tensor:
    """:func:`_entry_hash` as int32 bit patterns ``[len(rows), len(cols)]`` (bit 31 only with ``sign_only``)."""
    row_h, col_g, lane_salt = entry_hash_parts(key, rows, cols, lane)
    out = torch.empty(row_h.numel(), col_g.numel(), dtype=torch.int32, device=row_h.device)
    return entry_hash_block_(out, row_h, col_g, lane_salt, torch.empty_like(out), sign_only=sign_only)


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
