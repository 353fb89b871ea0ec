"""Combine HF tensors into megatron tensors and split them back: pure tensor functions of a :class:`TensorPlan`.

:func:`build_full` makes a full megatron tensor from its HF parts (``copy``, ``qkv`` fused per query group,
``fc1`` = ``[gate; up]``, ``vocab`` rows padded with zeros), :func:`build_shard` one TP rank's shard of it
reading only the HF rows that rank holds, and :func:`split_to_hf` is the inverse of :func:`build_full`.
Reading is the caller's (a ``read`` callable), so the same code serves conversion, loading and sync.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch

from megatron_logra.convert.tensor_plan import TensorPlan, shard
from megatron_logra.models.gpt import ModelConfig

__all__ = ["build_full", "build_shard", "split_to_hf"]


def build_full(entry: TensorPlan, read: Callable[..., torch.Tensor], cfg: ModelConfig,
               dtype: torch.dtype) -> torch.Tensor:
    """The full megatron tensor of ``entry``, its HF parts read by ``read(name, out=...)`` into place.

    ``copy`` / ``fc1`` / ``vocab`` parts are read straight into their rows of the result (the padded
    vocabulary rows are zeros); ``qkv`` parts are read one at a time and copied into their per-group
    rows. Peak memory: the result plus one q/k/v part.
    """
    full = torch.empty(entry.shape, dtype=dtype)
    if entry.kind == "copy":
        read(entry.sources[0], out=full)
    elif entry.kind == "vocab":
        rows = cfg.vocab_size
        if rows > entry.shape[0]:
            raise ValueError(f"{entry.sources[0]} has {rows} rows, more than the padded vocabulary {entry.shape[0]}")
        read(entry.sources[0], out=full[:rows])
        full[rows:].zero_()
    elif entry.kind == "fc1":
        half = entry.shape[0] // 2
        read(entry.sources[0], out=full[:half])
        read(entry.sources[1], out=full[half:])
    elif entry.kind == "qkv":
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        d, per, rest = cfg.head_dim, heads // groups, tuple(entry.shape[1:])
        grouped = full.view(groups, per + 2, d, *rest)
        slots = (slice(0, per), slice(per, per + 1), slice(per + 1, per + 2))
        for name, slot in zip(entry.sources, slots):
            part = read(name)
            if part.dtype != dtype:
                raise ValueError(f"HF tensor {name} is {part.dtype}, the other parts of {entry.name} are {dtype}")
            grouped[:, slot].copy_(part.reshape(groups, slot.stop - slot.start, d, *rest))
            del part
    else:  # pragma: no cover - megatron_plan only makes the kinds above
        raise ValueError(f"unknown tensor kind {entry.kind!r}")
    return full


_SOURCE_SHIFT = 40  # row codes: (source index << 40) + row + 1; 0 marks a padded row


def build_shard(entry: TensorPlan, read: Callable[..., torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
                tp_rank: int, tp: int, source_rows: Callable[[str], int]) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``entry`` — equal to ``shard(build_full(...))`` — reading only
    the HF rows it holds when the tensor is split along its rows (QKV, ``fc1``, vocabulary: at
    TP = t each rank reads 1/t of those bytes). ``read(name, rows=(start, stop), out=...)`` reads a
    row range; ``source_rows(name)`` is an HF tensor's row count. Column-split and replicated
    tensors are built whole and sliced.

    Which HF rows land where is derived by running :func:`build_full` and :func:`shard` on row
    codes instead of values, so the layout logic exists once."""
    partition = entry.partition
    if partition is None or tp == 1 or partition[0] != 0:
        return shard(build_full(entry, read, cfg, dtype), partition, tp_rank, tp).contiguous()

    def code_read(name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = source_rows(name)
        codes = (torch.arange(n, dtype=torch.int64) + 1 + (entry.sources.index(name) << _SOURCE_SHIFT)).view(n, 1)
        if out is None:
            return codes
        return out.copy_(codes.view_as(out))

    codes = shard(build_full(replace(entry, shape=(entry.shape[0], 1)), code_read, cfg, torch.int64),
                  partition, tp_rank, tp).reshape(-1)
    out = torch.zeros((codes.numel(), *entry.shape[1:]), dtype=dtype)
    # runs of consecutive rows of one source: a new run wherever the code does not advance by one
    breaks = torch.nonzero(codes[1:] - codes[:-1] != 1).reshape(-1) + 1
    bounds = [0, *breaks.tolist(), codes.numel()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        code = int(codes[a])
        if code == 0:  # padded vocabulary rows stay zero (runs of padding advance by 0, one row per run)
            continue
        src, row = code >> _SOURCE_SHIFT, (code & ((1 << _SOURCE_SHIFT) - 1)) - 1
        read(entry.sources[src], rows=(row, row + b - a), out=out[a:b])
    return out


def split_to_hf(entry: TensorPlan, full: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`build_full`: HF ``(name, tensor)`` pairs of a full megatron tensor, one at a time.

    Tensors are views of ``full`` where possible (rows of ``fc1``, the unpadded vocabulary rows);
    q / k / v are copied out one by one.
    """
    if entry.kind == "qkv":
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        d, per, rest = cfg.head_dim, heads // groups, tuple(full.shape[1:])
        grouped = full.view(groups, per + 2, d, *rest)
        for name, slot, n in zip(entry.sources, (slice(0, per), slice(per, per + 1), slice(per + 1, per + 2)),
                                 (heads, groups, groups)):
            yield name, grouped[:, slot].reshape(n * d, *rest)
    elif entry.kind == "fc1":
        half = full.shape[0] // 2
        yield entry.sources[0], full[:half]
        yield entry.sources[1], full[half:]
    elif entry.kind == "vocab":
        yield entry.sources[0], full[: cfg.vocab_size]
    else:
        yield entry.sources[0], full
