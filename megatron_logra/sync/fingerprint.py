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

import torch

logger = logging.getLogger(__name__)

__all__ = ["sample_rows", "fingerprint", "combined", "drift"]


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


@torch.no_grad()
def fingerprint(weights: dict[str, torch.Tensor], rows_per_tensor: int = 4) -> dict[str, str]:
    """Name -> sha256 hex of the sampled rows (see module docstring)."""
    out: dict[str, str] = {}
    for name in sorted(weights):
        t = weights[name].detach()
        mat = t.reshape(1, -1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)
        rows = sample_rows(name, mat.shape[0], rows_per_tensor)
        h = hashlib.sha256(f"{name}|{t.dtype}|{list(t.shape)}|{rows}|".encode())
        if rows and mat.shape[1]:
            idx = torch.tensor(rows, dtype=torch.int64, device=mat.device)
            sample = mat.index_select(0, idx).contiguous().cpu()
            h.update(memoryview(sample.view(torch.uint8).reshape(-1).numpy()))
        out[name] = h.hexdigest()
    return out


def combined(fp: dict[str, str]) -> str:
    """One sha256 hex over a fingerprint dict (order independent)."""
    h = hashlib.sha256()
    for name in sorted(fp):
        h.update(f"{name}={fp[name]};".encode())
    return h.hexdigest()


def drift(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ or that only one side has (sorted)."""
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
