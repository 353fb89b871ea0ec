"""Read a sharded checkpoint as plain global tensors, one key at a time, in any process.

For tools (export to Hugging Face, inspection, tests): no model and no parallel layout needed.
Keys are megatron-core's global checkpoint keys: layers of a pipeline are stacked along a
leading axis (``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, ...]``),
tensor-parallel splits are joined (TP=1 layout), optimizer state is under ``optimizer.``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Union

import torch
import torch.distributed as dist

from megatron_logra.checkpoint.integrity import CheckpointError, read_meta

logger = logging.getLogger(__name__)

__all__ = ["PlainCheckpoint"]


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """torch.distributed.checkpoint reads through a process group: use the caller's, or a private
    1-process gloo group for the duration of the read."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class PlainCheckpoint:
    """A trainer checkpoint (``RUN/checkpoints/step_XXXXXXXX``) opened for plain reads. Opening it checks
    meta.json, every file's size and CRC-32, and that ``dist/``'s pickles hold plain data only
    (:func:`~megatron_logra.checkpoint.integrity.read_meta`), before megatron-core reads the index."""

    def __init__(self, path: Union[str, Path]) -> None:
        from megatron.core import dist_checkpointing

        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.dist_dir = str(self.path / "dist")
        try:
            with _process_group():
                self._sharded = dist_checkpointing.load_tensors_metadata(self.dist_dir)
        except Exception as exc:
            raise CheckpointError(f"{self.dist_dir}: unreadable sharded checkpoint metadata: {exc}") from exc

    def keys(self) -> list[str]:
        return sorted(self._sharded)

    def __contains__(self, key: str) -> bool:
        return key in self._sharded

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key).global_shape)

    def _entry(self, key: str):
        if key not in self._sharded:
            raise CheckpointError(f"{self.path}: no tensor {key!r} (has {len(self._sharded)} keys, e.g. "
                                  f"{self.keys()[:3]})")
        return self._sharded[key]

    def read(self, key: str) -> torch.Tensor:
        """The whole global tensor ``key``."""
        from megatron.core import dist_checkpointing

        entry = self._entry(key)
        try:
            with _process_group():
                out = dist_checkpointing.load({key: entry}, self.dist_dir, validate_access_integrity=False)
        except Exception as exc:
            raise CheckpointError(f"{self.dist_dir}: cannot read {key!r}: {exc}") from exc
        return out[key]

    def read_all(self) -> dict[str, torch.Tensor]:
        return {k: self.read(k) for k in self.keys()}
