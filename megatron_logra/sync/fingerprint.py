"""Cheap fingerprints of a weights dict, to detect trainer/engine drift.

For each tensor, sha256 over its name, dtype, shape and the raw bytes of a deterministic
sample of rows: the first and last row plus ``rows_per_tensor`` rows drawn from a generator
seeded by the tensor's name (BLAKE2b, stable across processes). Two sides holding bitwise
equal tensors in the same layout get equal fingerprints; a single flipped bit in a sampled
row changes it. Unsampled rows are not covered: this is a drift *detector*, run on every
sync, backed by a periodic full refit. Imports only torch and the standard library.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Iterable, Mapping, Sequence, Union

import torch

logger = logging.getLogger(__name__)

__all__ = ["sample_rows", "sampled_rows_of", "digest", "fingerprint", "combined", "drift"]


def sample_rows(name: str, n_rows: int, rows_per_tensor: int = 4) -> list[int]:
    """Sorted distinct row indices sampled for tensor ``name`` with ``n_rows`` rows."""
    if n_rows <= 0:
        return []
    seed = int.from_bytes(hashlib.blake2b(f"logra-fingerprint|{name}".encode(), digest_size=8).digest(), "little")
    rows = {0, n_rows - 1}
    state = seed
    for _ in range(rows_per_tensor):
        state = (state * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)  # LCG (Knuth MMIX)
        rows.add((state >> 33) % n_rows)
    return sorted(rows)


def sampled_rows_of(name: str, shape: Sequence[int], rows_per_tensor: int = 4) -> list[int]:
    """Rows of tensor ``name`` (full shape ``shape``) that its fingerprint covers.

    A tensor of rank <= 1 is one row; otherwise rows index dim 0 and the rest is flattened.
    """
    return sample_rows(name, 1 if len(shape) <= 1 else int(shape[0]), rows_per_tensor)


def digest(name: str, dtype: torch.dtype, shape: Sequence[int], rows: Sequence[int], sample: torch.Tensor) -> str:
    """sha256 hex of one tensor's fingerprint from its sampled rows ``sample`` ``[len(rows), row width]``.

    The single definition of what a fingerprint hashes, so a side that assembles the sampled
    rows from shards (a TP-sharded trainer or engine) and a side that holds the whole tensor
    produce equal digests exactly when the sampled bytes are equal.
    """
    h = hashlib.sha256(f"{name}|{dtype}|{list(shape)}|{list(rows)}|".encode())
    if len(rows) and sample.numel():
        h.update(memoryview(sample.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()))
    return h.hexdigest()


@torch.no_grad()
def fingerprint(weights: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                rows_per_tensor: int = 4) -> dict[str, str]:
    """Name -> sha256 hex of the sampled rows (see module docstring).

    ``weights``: a mapping, or an iterable of ``(name, tensor)`` pairs that is consumed once
    (so a caller can stream tensors one at a time and never hold them all).
    """
    out: dict[str, str] = {}
    for name, t in (weights.items() if isinstance(weights, Mapping) else weights):
        t = t.detach()
        mat = t.reshape(1, -1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)
        rows = sampled_rows_of(name, t.shape, rows_per_tensor)
        sample = mat.index_select(0, torch.tensor(rows, dtype=torch.int64, device=mat.device)) if rows else mat[:0]
        out[name] = digest(name, t.dtype, t.shape, rows, sample)
    return dict(sorted(out.items()))


def combined(fp: dict[str, str]) -> str:
    """One sha256 hex over a fingerprint dict (order independent)."""
    h = hashlib.sha256()
    for name in sorted(fp):
        h.update(f"{name}={fp[name]};".encode())
    return h.hexdigest()


def drift(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or that only one side has (sorted)."""
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
