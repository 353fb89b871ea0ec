"""Cheap fingerprints of a weights dict, to detect trainer/engine drift.

For each tensor, sha256 over its name, dtype, shape and the raw bytes of a deterministic
sample of rows: the first and last row plus ``rows_per_tensor`` rows drawn from a generator
seeded by the tensor's name and an optional integer ``salt`` (BLAKE2b, stable across
processes). Two sides holding bitwise equal tensors in the same layout get equal fingerprints
when they sample with the same salt; a single flipped bit in a sampled row changes it.

**Salt.** Policy sync salts with the weight version the fingerprint is taken at, so successive
checks sample different rows and, over ``~n_rows / rows_per_tensor`` checks, every row of an
``n_rows`` tensor (unsalted, a tensor's sample is the same rows forever and a divergence in any
other row is never seen). A salted digest carries its salt as a suffix, ``<sha256 hex>@<salt>``,
so the side that compares (the trainer) learns from the other side's fingerprint which rows it
sampled (:func:`fingerprint_salt`) and samples the same ones; an unsalted digest is the bare hex.
Digests of different salts never compare equal. Rows not sampled at a given check are not
covered by it: this is a drift *detector*, backed by full refits (``sync.anchor_interval``,
drift repairs). Imports only torch and the standard library.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

logger = logging.getLogger(__name__)

__all__ = ["sample_rows", "sampled_rows_of", "digest", "fingerprint", "fingerprint_salt", "combined", "drift"]


def _check_salt(salt: Optional[int]) -> None:
    if salt is not None and (isinstance(salt, bool) or not isinstance(salt, int)):
        raise ValueError(f"a fingerprint salt is an int (the weight version) or None, got {salt!r}")


def sample_rows(name: str, n_rows: int, rows_per_tensor: int = 4, salt: Optional[int] = None) -> list[int]:
    """Sorted distinct row indices sampled for tensor ``name`` with ``n_rows`` rows: the first and the
    last row and ``rows_per_tensor`` draws seeded by ``name`` and ``salt`` (None: the name alone)."""
    _check_salt(salt)
    if n_rows <= 0:
        return []
    key = f"logra-fingerprint|{name}" if salt is None else f"logra-fingerprint|{name}|salt={salt}"
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    rows = {0, n_rows - 1}
    state = seed
    for _ in range(rows_per_tensor):
        state = (state * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)  # LCG (Knuth MMIX)
        rows.add((state >> 33) % n_rows)
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
