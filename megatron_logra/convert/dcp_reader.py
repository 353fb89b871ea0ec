"""Read tensors of a megatron-core ``torch_dist`` checkpoint, whole or one stacked layer at a time.

Used by the Hugging Face export of trainer checkpoints (``convert.mcore_checkpoint``): megatron-core
stacks the layers of a parameter into one ``[num_layers, ...]`` key, and exporting layer by layer
must not read the whole stack once per layer (28.7 GB per read for a 27B ``linear_fc1``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["DistTensors"]


class DistTensors:
    """Global tensors of a megatron-core ``torch_dist`` checkpoint directory (torch.distributed.checkpoint
    storage), read whole or one index of their leading (stacked-layer) axis at a time.

    Only the stored chunks overlapping the request are read (each whole: megatron-core stores one
    chunk per layer and TP rank, so a layer slice reads exactly that layer's chunks). megatron-core's
    own ``dist_checkpointing.load`` cannot load a slice in a single-process world (it places the
    other fragments on rank ``(r + 1) % world_size``, here the reader itself), hence a DCP load
    planner of our own. No process group is needed (``no_dist``).
    """

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader

        from megatron_logra.checkpoint.dcp_metadata import read_dcp_metadata

        class _Reader(FileSystemReader):  # metadata read once, not on every load
            def read_metadata(self, *args, **kwargs):
                return metadata

        try:
            metadata = read_dcp_metadata(path)  # restricted unpickler: no code runs from a crafted file
        except Exception as exc:
            raise ValueError(f"{path}: unreadable torch.distributed.checkpoint metadata: {exc}") from None
        self.path, self.metadata, self._reader = path, metadata, _Reader(str(path))

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is a stored tensor (not a byte object)."""
        return hasattr(self.metadata.state_dict_metadata.get(key), "chunks")

    def shape(self, key: str) -> tuple[int, ...]:
        """The global shape of the stored tensor ``key`` (from the metadata: nothing is read)."""
        return tuple(self._md(key).size)

    def _md(self, key: str):
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise ValueError(f"{self.path}: no stored tensor {key!r}")
        return md

    def dtype(self, key: str) -> torch.dtype:
        return self._md(key).properties.dtype

    def read(self, key: str, index: Optional[int] = None) -> torch.Tensor:
        """The global tensor ``key``, or its ``[index]`` along the leading axis (a new tensor, contiguous)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md, path = self._md(key), self.path
        size = tuple(md.size)
        if index is not None and not (len(size) >= 1 and 0 <= index < size[0]):
            raise ValueError(f"{path}: tensor {key!r} of shape {list(size)} has no index {index} on its first axis")
        rows = size if index is None else (1, *size[1:])
        offsets = (0,) * len(size) if index is None else (index,) + (0,) * (len(size) - 1)
        buf = torch.empty(rows, dtype=md.properties.dtype)

        class _Slice(DefaultLoadPlanner):
            def create_local_plan(self) -> LoadPlan:
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(rows))
                items = create_read_items_for_chunk_list(key, md, [chunk])
                covered = sum(int(torch.Size(i.lengths).numel()) for i in items)
                if covered != buf.numel():  # else rows would stay uninitialised
                    raise ValueError(f"{path}: the stored chunks of {key!r} cover {covered} of the {buf.numel()} "
                                     f"elements at offset {list(offsets)}")
                return LoadPlan(items)

            def lookup_tensor(self, index_):
                return buf

        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({key: buf}, storage_reader=self._reader, no_dist=True,
                         planner=_Slice(flatten_state_dict=False, flatten_sharded_tensors=False))
        except (Exception, CheckpointException):
            if not Path(path).exists():  # a trainer checkpoint's dist/: the job training the run pruned it
                from megatron_logra.checkpoint.integrity import removed_while_read

                raise ValueError(removed_while_read(Path(path).parent)) from None  # the step_* directory
            raise
        return buf if index is None else buf[0]
