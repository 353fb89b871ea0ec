"""Reader of a megatron checkpoint: per-rank files written by the converter, or a trainer checkpoint.

:class:`McoreCheckpoint` — a directory with one ``model_tp{t}_pp{p}.safetensors`` per model-parallel
rank and a ``meta.json``: either written by :func:`megatron_logra.convert.convert_hf_to_mcore`
(``format = "megatron_logra.mcore"``, sha256 per file) or a trainer checkpoint of
:mod:`megatron_logra.checkpoint` (``RUN/checkpoints/step_XXXXXXXX``: megatron-core sharded checkpoint under ``dist/``; model config
under ``config.model``; ``meta.json``'s CRC-32 and file sizes checked, and the CRC-32 of every file
unless ``verify=False``). A trainer checkpoint stores each per-layer tensor kind as
one global ``[num_layers, ...]`` key made of one chunk per layer (and TP rank); it is read one layer
slice at a time (:class:`DistTensors`), so an export reads every stored chunk once and holds one
layer's slice of one key, whatever the number of layers; dtypes come from the checkpoint metadata.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_logra.convert.dcp_reader import DistTensors
from megatron_logra.convert.hf_config import model_config_from_json
from megatron_logra.convert.st_io import TensorFile, sha256_file
from megatron_logra.convert.tensor_plan import TensorPlan, place_shard, shard_shape
from megatron_logra.models.presets import read_json_object

__all__ = ["McoreCheckpoint", "MCORE_FORMAT", "MCORE_FORMAT_VERSION", "rank_file_name"]

MCORE_FORMAT = "megatron_logra.mcore"
MCORE_FORMAT_VERSION = 1


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)\.(.+)$")


_FUSED_NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def rank_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank}_pp{pp_rank}.safetensors"


class McoreCheckpoint:
    """Per-rank megatron safetensors files plus ``meta.json`` (converter output or a trainer checkpoint)."""

    def __init__(self, mcore_dir: Union[str, Path], *, verify: bool = True):
        """Open ``mcore_dir``. A trainer checkpoint's ``meta.json`` is checked on open: its own CRC-32 and every
        recorded file's size, and, with ``verify``, every file's CRC-32 (a full read of the checkpoint,
        optimizer state included). A converted directory's sha256s are checked per rank file when it is
        opened (:meth:`file`, ``verify``)."""
        self.dir = Path(mcore_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{self.dir}: no meta.json (expected a converted megatron checkpoint or a trainer "
                             "checkpoint step directory)")
        meta = read_json_object(meta_path)
        self.meta = meta
        if meta.get("format") == MCORE_FORMAT:
            if meta.get("format_version") != MCORE_FORMAT_VERSION:
                raise ValueError(f"{meta_path}: format_version={meta.get('format_version')!r}, this reader reads "
                                 f"{MCORE_FORMAT_VERSION}")
            self.cfg = model_config_from_json(meta.get("model_config") or {}, str(meta_path))
            self.prefix = ""
            self._dist = None
            self.checksums = {k: v.get("sha256") for k, v in (meta.get("files") or {}).items()}
            self.sizes = {k: v.get("bytes") for k, v in (meta.get("files") or {}).items()}
            self.kind = "converted"
        elif "step" in meta and isinstance(meta.get("config"), dict) and isinstance(meta["config"].get("model"), dict):
            from megatron_logra.checkpoint.integrity import read_meta

            self.cfg = model_config_from_json(meta["config"]["model"], f"{meta_path} (config.model)")
            read_meta(self.dir, checksums=verify)  # CheckpointError (a ValueError) naming a bad file
            # sharded (dist_checkpointing): global tensors, layers stacked along a leading axis
            self._dist: Optional[DistTensors] = DistTensors(self.dir / "dist")
            self.prefix = ""
            self.checksums = {}
            self.sizes = {}
            self.kind = "trainer"
        else:
            raise ValueError(f"{meta_path}: neither a converted checkpoint (format={MCORE_FORMAT!r}) nor a trainer "
                             "checkpoint (step + config.model)")
        try:
            self.tp, self.pp = int(meta["tp"]), int(meta["pp"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{meta_path}: needs integer fields tp and pp") from None
        self._readers: dict[tuple[int, int], TensorFile] = {}

    @property
    def hf_files_dir(self) -> Optional[Path]:
        """``hf/`` of a converted checkpoint: the source config.json, tokenizer and generation config."""
        path = self.dir / "hf"
        return path if path.is_dir() else None

    def file(self, tp_rank: int, pp_rank: int, *, verify: bool = True) -> TensorFile:
        if self.kind == "trainer":
            raise ValueError(f"{self.dir} is a sharded trainer checkpoint, not per-rank files: continue it with "
                             "`megatron-logra train --resume RUN_DIR` (any layout) or export it with mcore-to-hf")
        key = (tp_rank, pp_rank)
        if key not in self._readers:
            name = rank_file_name(tp_rank, pp_rank)
            path = self.dir / name
            if not path.is_file():
                raise ValueError(f"{self.dir}: rank file {name} is missing (meta.json says tp={self.tp} pp={self.pp})")
            expected = self.checksums.get(name)
            if self.kind == "converted" and expected is None:
                raise ValueError(f"{self.dir / 'meta.json'}: no checksum for {name}")
            size, recorded = path.stat().st_size, self.sizes.get(name)
            if isinstance(recorded, int) and size != recorded:  # checked without reading it: even with verify off
                what = "cut short (an interrupted copy?)" if size < recorded else "longer than written"
                raise ValueError(f"{path}: {size} bytes, meta.json records {recorded}: the file is {what}; copy it "
                                 "again from the conversion's output, or convert again")
            if verify and expected is not None:
                actual = sha256_file(path)
                if actual != expected:
                    raise ValueError(f"{path}: sha256 {actual[:16]}... does not match meta.json ({expected[:16]}...): "
                                     "the file is corrupt or was modified")
            self._readers[key] = TensorFile(path)
        return self._readers[key]

    def _trainer_key(self, entry: TensorPlan) -> tuple[str, Optional[int]]:
        """Global checkpoint key of ``entry`` and its index along the stacked-layer axis. A tied model
        (``untie_embeddings_and_output_weights`` false) stores ``output_layer.weight`` once, as the embeddings,
        which it then reads; an untied model without ``output_layer.weight`` is a ``ValueError`` naming the
        tensor and the checkpoint."""
        m = _LAYER.match(entry.name)
        if m is None:
            if entry.name == "output_layer.weight" and self._dist is not None and entry.name not in self._dist:
                if self.cfg.untie_embeddings_and_output_weights:
                    raise ValueError(f"{self.dir}: the checkpoint has no tensor 'output_layer.weight', but its config "
                                     "(config.model.untie_embeddings_and_output_weights=true) says the output layer "
                                     "is separate from the embeddings: the checkpoint is incomplete or its config "
                                     "does not match its weights; refusing to export the embeddings as lm_head")
                return "embedding.word_embeddings.weight", None  # tied: stored once, as the embedding
            return entry.name, None
        key = m.group(1) + m.group(3)
        if self._dist is not None and key not in self._dist:
            for local, stored in _FUSED_NORM_KEYS.items():  # megatron stores local-spec norms under TE names
                if m.group(3).startswith(local):
                    key = m.group(1) + stored + m.group(3)[len(local):]
        return key, int(m.group(2))

    def _trainer_validate(self, plan: list[TensorPlan]) -> None:
        assert self._dist is not None
        for e in plan:
            key, layer = self._trainer_key(e)
            if key not in self._dist:
                raise ValueError(f"{self.dir}: the checkpoint has no tensor {key!r} for {e.name} "
                                 "(does config.model match the weights?)")
            shape = self._dist.shape(key)
            want = e.shape if layer is None else (self.cfg.num_layers, *e.shape)
            if tuple(shape) != tuple(want):
                raise ValueError(f"{self.dir}: tensor {key!r} has shape {list(shape)}, expected {list(want)}")

    def _trainer_read(self, entry: TensorPlan) -> torch.Tensor:
        """``entry``'s tensor: its layer's slice of the stacked key (only that layer's chunks are read)."""
        assert self._dist is not None
        return self._dist.read(*self._trainer_key(entry))

    def validate(self, plan: list[TensorPlan], *, verify: bool = True) -> None:
        """Every rank file holds exactly the plan's tensors with the plan's shard shapes (``ValueError`` naming it)."""
        if self.kind == "trainer":
            self._trainer_validate(plan)
            return
        for pp_rank in range(self.pp):
            stage = [e for e in plan if e.pp_rank == pp_rank]
            for tp_rank in range(self.tp):
                f = self.file(tp_rank, pp_rank, verify=verify)
                expected = {self.prefix + e.local_name: shard_shape(e.shape, e.partition, self.tp) for e in stage}
                unknown = sorted(set(f.tensors) - set(expected))
                missing = sorted(set(expected) - set(f.tensors))
                if unknown or missing:
                    raise ValueError(f"{f.path}: does not match the model config at tp={self.tp} pp={self.pp}: "
                                     f"missing tensors {missing[:8]}, unknown tensors {unknown[:8]}")
                for name, shape in expected.items():
                    if f.tensors[name].shape != shape:
                        raise ValueError(f"{f.path}: tensor {name!r} has shape {list(f.tensors[name].shape)}, "
                                         f"expected {list(shape)} at tp={self.tp}")

    def dtype(self, entry: TensorPlan) -> torch.dtype:
        if self.kind == "trainer":  # from the metadata: nothing is read
            assert self._dist is not None
            return self._dist.dtype(self._trainer_key(entry)[0])
        return self.file(0, entry.pp_rank).tensors[self.prefix + entry.local_name].dtype

    def read_full(self, entry: TensorPlan) -> torch.Tensor:
        """The full (TP-unsharded) tensor of ``entry``, rank file by rank file into place.

        Peak memory: the result plus one shard (a trainer checkpoint: the result, one layer's slice of
        one stacked key). TP-replicated tensors (norms, row-parallel biases) must be bitwise equal on
        every TP rank, else ``ValueError``.
        """
        if self.kind == "trainer":
            return self._trainer_read(entry)
        dtype = self.dtype(entry)
        if entry.partition is None:
            first = self.file(0, entry.pp_rank).read(self.prefix + entry.local_name)
            for t in range(1, self.tp):
                other = self.file(t, entry.pp_rank).read(self.prefix + entry.local_name)
                if not torch.equal(other, first):
                    raise ValueError(f"{self.dir}: replicated tensor {entry.local_name!r} of stage {entry.pp_rank} "
                                     f"differs between TP rank 0 and TP rank {t}")
            return first
        full = torch.empty(entry.shape, dtype=dtype)
        for t in range(self.tp):
            piece = self.file(t, entry.pp_rank).read(self.prefix + entry.local_name)
            if piece.dtype != dtype:
                raise ValueError(f"{self.dir}: tensor {entry.local_name!r} of stage {entry.pp_rank} is {piece.dtype} on "
                                 f"TP rank {t} and {dtype} on TP rank 0")
            place_shard(full, piece, entry.partition, t, self.tp)
            del piece
        return full

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
