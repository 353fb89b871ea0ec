"""The merge-rounding noise: where the random bits of a stochastically rounded bf16 merge come from.

**Stochastic rounding.** A KL-controlled step is far below bf16's spacing: rounded to nearest, most
of it vanishes from a bf16 weight (and from the engine that mirrors it). With ``stochastic`` the
16 bits bf16 drops are rounded up with probability equal to their value (unbiased), by adding
16-bit noise to the fp32 bit pattern and truncating. The noise of entry ``(i, j)`` is
``ρ_i XOR γ_j``: 16-bit counter hashes of ``(seed, target#merge-rounding, optimizer step, canonical
row i)`` and of ``(..., column j)`` (:class:`StochasticRounding`), where the canonical rows are those of
the target's TP=1 Megatron ``U``: the trainer at any TP degree and every engine layout draw the same
noise for the same entry, so they stay bitwise equal. Each entry's noise is uniform on 16 bits and any
two entries' noises are independent (two entries share at most a row or a column hash, and XOR with
the other, independent hash makes the pair uniform on 32 bits), so every entry is rounded without
bias and the rounding error of any sum of entries has the variance of independent noise (variances
involve pairs only). A full per-entry hash would add nothing to either, and costs about 25 passes
over each weight where the XOR costs one.
fp16 weights are rounded to nearest either way.

This is the part of the merge that trainer and engines must agree on bit for bit without sharing a layout
(canonical rows, hash keys, the hash lane), kept apart from the arithmetic in :mod:`megatron_logra.sync.merge`.
Like it, this module imports only ``torch``, the standard library and the projection hashes (engine side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.sketch.random_projection import entry_hash_parts_many, projection_key

__all__ = ["StochasticRounding", "noise_parts", "shard_rows", "rounding_key", "ROUNDING_LANE"]


ROUNDING_LANE = 3
"""Hash lane of the merge-rounding noise (the projections use lanes 0-2)."""


@dataclass(frozen=True)
class StochasticRounding:
    """Where the merge-rounding noise of one bf16 weight comes from (see the module docstring)."""

    seed: int
    """The projection seed of the update."""
    target: str
    """Canonical target name."""
    step: int
    """The optimizer step of the update (the delta's ``step``): unique per update, so each update
    draws fresh noise. (The projection's update index is not: it stays 0 without
    ``logra.refresh``, and noise repeated every update rounds the same entries the same way each
    time, a bias that grows with the run.)"""
    rows: Optional[torch.Tensor] = None
    """Canonical rows (of the target's TP=1 Megatron ``U``) of this weight's rows, in order; None: all."""
    col_start: int = 0
    """The first column of the layer's input this weight holds (row-parallel shards)."""

    def parts(self, n_out: int, n_in: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The row hashes ``ρ`` ``[n_out]`` and column hashes ``γ`` ``[n_in]`` (int32 in ``[0, 2^16)``) of the
        noise ``ρ_i XOR γ_j`` of an ``[n_out, n_in]`` weight (small; computed before any write)."""
        return noise_parts([self], [(n_out, n_in)], device)[0]


def rounding_key(seed: int, target: str, step: int) -> tuple[int, int, int, int]:
    """The hash key of the merge-rounding noise of ``target`` (canonical) at optimizer ``step``."""
    return projection_key(seed, f"{target}#merge-rounding", step)


def noise_parts(roundings: list[StochasticRounding], shapes: list[tuple[int, int]], device: torch.device
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`StochasticRounding.parts` of several weights on one device, computed together (a dozen ops in
    all: an apply rounds hundreds of weights)."""
    keys, rows, cols = [], [], []
    for rounding, (n_out, n_in) in zip(roundings, shapes, strict=True):
        r = torch.arange(n_out, device=device) if rounding.rows is None else rounding.rows.to(device)
        if r.numel() != n_out:
            raise ValueError(f"{rounding.target}: {r.numel()} canonical rows for a weight of {n_out} rows")
        keys.append(rounding_key(rounding.seed, rounding.target, rounding.step))
        rows.append(r)
        cols.append(torch.arange(rounding.col_start, rounding.col_start + n_in, device=device))
    # both are murmur-finalised (columns times an odd constant: a bijection of the low 16 bits)
    row_bits, col_bits = entry_hash_parts_many(keys, rows, cols, ROUNDING_LANE, low_bits=16)
    return list(zip(row_bits, col_bits))


def shard_rows(n_out_local: int, tp_rank: int, tp_size: int, stride: int = 1) -> torch.Tensor:
    """Canonical rows (TP=1 Megatron order) of the column-parallel shard of ``n_out_local`` rows that TP rank
    ``tp_rank`` of ``tp_size`` holds, when the weight interleaves ``stride`` row blocks (megatron's
    ``partition_stride``: 2 for ``linear_fc1`` = ``[gate; up]``, of which each rank holds ``[gate_k; up_k]``)."""
    if stride < 1 or n_out_local % stride:
        raise ValueError(f"a shard of {n_out_local} rows cannot hold {stride} row blocks")
    per = n_out_local // stride
    block = per * tp_size  # rows of each of the ``stride`` blocks of the canonical U
    return torch.cat([torch.arange(b * block + tp_rank * per, b * block + (tp_rank + 1) * per) for b in range(stride)])
