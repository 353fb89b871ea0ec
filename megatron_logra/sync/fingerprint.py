"""Cheap fingerprints of a weights dict, to detect trainer/engine drift.

For each tensor, sha256 over its name, dtype, shape and the raw bytes of a deterministic
sample of rows (:func:`sample_rows`): the first and the last row plus ``rows_per_tensor`` rows
of a fixed pseudo-random permutation of the tensor's rows (keyed by its name, BLAKE2b: stable
across processes), the window of the permutation that an optional integer ``salt`` selects. Two
sides holding bitwise equal tensors in the same layout get equal fingerprints when they sample
with the same salt; a single flipped bit in a sampled row changes it.

**Salt: a sweep.** The permutation of an ``n_rows`` tensor is cut into ``W`` windows of
``rows_per_tensor`` consecutive positions (wrapping around), ``W`` the smallest prime ``>=
max(n_rows / rows_per_tensor, 31)``, and salt ``s`` samples window ``s mod W``. Policy sync salts
with the weight version the fingerprint is taken at, so checks at ``W`` consecutive versions sample
every row of the tensor (the windows of successive versions are disjoint until the sweep wraps:
about ``n_rows / rows_per_tensor`` checks for a tensor of more than ``31 * rows_per_tensor`` rows),
and so do ``W`` checks ``c`` versions apart (``sync.check_interval = c``) whenever ``c`` is not a
multiple of the prime ``W``. Unsalted, a tensor's sample is window 0 forever and a divergence in any other row is
never seen. A salted digest carries its salt as a suffix, ``<sha256 hex>@<salt>``, so the side that
compares (the trainer) learns from the other side's fingerprint which rows it sampled
(:func:`fingerprint_salt`) and samples the same ones; an unsalted digest is the bare hex. Digests of
different salts never compare equal. Rows not sampled at a given check are not covered by it: this
is a drift *detector*, backed by full refits (``sync.anchor_interval``, drift repairs). Imports
only torch and the standard library.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

logger = logging.getLogger(__name__)

__all__ = ["sample_rows", "sampled_rows_of", "digest", "fingerprint", "fingerprint_salt", "combined", "drift"]


def _check_salt(salt: Optional[int]) -> None:
    if salt is not None and (isinstance(salt, bool) or not isinstance(salt, int)):
        raise ValueError(f"a fingerprint salt is an int (the weight version) or None, got {salt!r}")


# at least this many windows (a prime): a check interval that is a multiple of a tensor's window count would
# sample the same window at every check, and check intervals of 31 or more are rare
_MIN_WINDOWS = 31


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


@functools.lru_cache(maxsize=8192)
def _sweep(name: str, n_rows: int, k: int) -> tuple[int, int, int]:
    """``(a, b, windows)``: tensor ``name``'s row permutation ``position -> (a * position + b) mod n_rows``
    (``a`` coprime with ``n_rows``: a bijection keyed by the name) and its number of windows of ``k``
    positions, the smallest prime ``>= max(ceil(n_rows / k), 31)``."""
    h = hashlib.blake2b(f"logra-fingerprint|{name}".encode(), digest_size=16).digest()
    a = 1 + int.from_bytes(h[:8], "little") % (n_rows - 1) if n_rows > 1 else 1
    while math.gcd(a, n_rows) != 1:
        a = a % (n_rows - 1) + 1
    windows = max(_MIN_WINDOWS, -(-n_rows // k))
    while not _is_prime(windows):
        windows += 1
    return a, int.from_bytes(h[8:], "little") % n_rows, windows


def sample_rows(name: str, n_rows: int, rows_per_tensor: int = 4, salt: Optional[int] = None) -> list[int]:
    """Sorted distinct row indices sampled for tensor ``name`` with ``n_rows`` rows: the first and the
    last row, and the ``rows_per_tensor`` rows at positions ``w * rows_per_tensor ... w * rows_per_tensor +
    rows_per_tensor - 1`` (mod ``n_rows``) of the tensor's fixed row permutation, window ``w = salt mod W``
    (None: window 0). See the module docstring: successive salts sweep every row in ``W`` checks."""
    _check_salt(salt)
    if n_rows <= 0:
        return []
    rows = {0, n_rows - 1}
    k = int(rows_per_tensor)
    if k >= n_rows:
        return list(range(n_rows))
    if k > 0:
        a, b, windows = _sweep(name, n_rows, k)
        start = (0 if salt is None else salt % windows) * k
        rows.update((a * ((start + j) % n_rows) + b) % n_rows for j in range(k))
    return sorted(rows)


def sampled_rows_of(name: str, shape: Sequence[int], rows_per_tensor: int = 4,
                    salt: Optional[int] = None) -> list[int]:
    """Rows of tensor ``name`` (full shape ``shape``) that its fingerprint with ``salt`` covers.

    A tensor of rank <= 1 is one row; otherwise rows index dim 0 and the rest is flattened.
    """
    return sample_rows(name, 1 if len(shape) <= 1 else int(shape[0]), rows_per_tensor, salt)


def digest(name: str, dtype: torch.dtype, shape: Sequence[int], rows: Sequence[int], sample: torch.Tensor,
           salt: Optional[int] = None) -> str:
    """One tensor's fingerprint from its sampled rows ``sample`` ``[len(rows), row width]``: the sha256 hex,
    followed by ``@<salt>`` when the rows were sampled with a ``salt`` (module docstring).

    The single definition of what a fingerprint hashes, so a side that assembles the sampled
    rows from shards (a TP-sharded trainer or engine) and a side that holds the whole tensor
    produce equal digests exactly when the sampled bytes (and the salts) are equal.
    """
    _check_salt(salt)
    h = hashlib.sha256(f"{name}|{dtype}|{list(shape)}|{list(rows)}|".encode())
    if len(rows) and sample.numel():
        h.update(memoryview(sample.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()))
    return h.hexdigest() if salt is None else f"{h.hexdigest()}@{salt}"


@torch.no_grad()
def fingerprint(weights: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                rows_per_tensor: int = 4, salt: Optional[int] = None) -> dict[str, str]:
    """Name -> digest of the rows sampled with ``salt`` (see module docstring; policy sync salts with the
    weight version).

    ``weights``: a mapping, or an iterable of ``(name, tensor)`` pairs that is consumed once
    (so a caller can stream tensors one at a time and never hold them all).
    """
    out: dict[str, str] = {}
    for name, t in (weights.items() if isinstance(weights, Mapping) else weights):
        t = t.detach()
        mat = t.reshape(1, -1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)
        rows = sampled_rows_of(name, t.shape, rows_per_tensor, salt)
        sample = mat.index_select(0, torch.tensor(rows, dtype=torch.int64, device=mat.device)) if rows else mat[:0]
        out[name] = digest(name, t.dtype, t.shape, rows, sample, salt)
    return dict(sorted(out.items()))


def fingerprint_salt(fp: Optional[Mapping[str, str]]) -> Optional[int]:
    """The salt ``fp``'s digests were sampled with (their ``@<salt>`` suffix), so the comparing side can sample
    the same rows; None for an unsalted fingerprint (or None, or an empty one). A fingerprint mixing salts (a broken one)
    gives the salt of its first salted digest in name order: the others then differ."""
    for name in sorted(fp or {}):
        head, sep, tail = fp[name].rpartition("@")
        if sep and head:
            try:
                return int(tail)
            except ValueError:
                continue
    return None


def combined(fp: dict[str, str]) -> str:
    """One sha256 hex over a fingerprint dict (order independent)."""
    h = hashlib.sha256()
    for name in sorted(fp):
        h.update(f"{name}={fp[name]};".encode())
    return h.hexdigest()


def drift(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or that only one side has (sorted)."""
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
