"""The counter-based entry hash under :mod:`megatron_logra.sketch.random_projection`.

Contract: the hash of an entry ``(row k, column j)`` of a projection is a pure function of the key
:func:`projection_key` derives from ``(seed, canonical layer name, update index)``, the indices and
a lane (0: Rademacher signs; 1, 2: Gaussian uniforms; others: e.g. the sync merge's rounding noise).
:func:`hash_u32` / :func:`_entry_hash` evaluate it with int64 torch ops whose intermediate values
never exceed 2**63 (identical on every backend); :func:`_hash_i32_` and the ``entry_hash_*``
functions evaluate the same integers on int32 bit patterns (two's-complement wrapping add and
multiply are arithmetic mod 2**32, shifts are masked to be logical), where the per-row and
per-column pre-hashes (:func:`entry_hash_parts`, :func:`entry_hash_parts_many`) are combined into
any block of entries in place (:func:`entry_hash_block_`, no allocation). Every function gives
the same bits as the plain-Python reference chain of the tests.

Imports only ``torch``, the standard library and :mod:`megatron_logra.sketch.naming`, as
:mod:`~megatron_logra.sketch.random_projection` does (inference engines import it).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from megatron_logra.sketch.naming import canonical_name

__all__ = ["hash_u32", "projection_key", "entry_hash_parts", "entry_hash_parts_many", "entry_hash_block_"]

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
# lowbias32 constants (Wellons, "hash-prospector").
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


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
