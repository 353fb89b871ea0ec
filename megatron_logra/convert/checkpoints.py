"""Readers of the two checkpoint kinds the converters move between.

:class:`HFCheckpoint` — a Hugging Face directory: ``config.json`` plus ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. Every shard's header is read and validated on
open (truncation, offsets, the index agreeing with the files); tensors are then read one at a
time. ``pytorch_model.bin`` is never read (no pickle).

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

import json
import logging
import re
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_logra.convert.spec import (
    IGNORED_HF_SUFFIXES,
    TensorPlan,
    model_config_from_json,
    place_shard,
    read_hf_config,
    shard_shape,
)
from megatron_logra.convert.dcp_reader import DistTensors
from megatron_logra.convert.st_io import TensorFile, TensorInfo, sha256_file
from megatron_logra.models.presets import read_json_object

logger = logging.getLogger(__name__)

__all__ = ["HFCheckpoint", "McoreCheckpoint", "MCORE_FORMAT", "MCORE_FORMAT_VERSION", "rank_file_name",
           "HF_EXTRA_FILES", "check_shard_name", "hf_tensor_not_imported", "resolve_mcore_dir"]

MCORE_FORMAT = "megatron_logra.mcore"
MCORE_FORMAT_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HF_EXTRA_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
"""Files copied alongside the weights when present (tokenizer and generation config)."""


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)\.(.+)$")


_FUSED_NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def rank_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank}_pp{pp_rank}.safetensors"


def check_shard_name(fname: str, index_path: Path) -> None:
    """``ValueError`` unless ``fname`` (a shard of ``index_path``'s ``weight_map``) is a plain file name of the
    index's own directory: no ``/`` or ``\\``, not hidden, not ``..`` (no absolute or escaping path)."""
    if not fname or "/" in fname or "\\" in fname or fname.startswith("."):
        raise ValueError(f"{index_path}: shard file name {fname!r} is not a plain file name (a shard must lie in the "
                         "index's own directory)")


def hf_tensor_not_imported(name: str, *, tied: bool) -> bool:
    """Whether an HF checkpoint may hold tensor ``name`` although no model parameter comes from it: buffers
    ending in :data:`IGNORED_HF_SUFFIXES` (``rotary_emb.inv_freq``, which older Llama checkpoints store and
    the model recomputes) and, for a tied model, ``lm_head.weight`` (a copy of the embeddings;
    :meth:`HFCheckpoint.check_tied_head` checks that it is one). The importer (:meth:`HFCheckpoint.validate`)
    and the export's template shard layout (``convert_mcore_to_hf(hf_template=)``) skip exactly these."""
    return name.endswith(IGNORED_HF_SUFFIXES) or (tied and name == "lm_head.weight")


class HFCheckpoint:
    """A Hugging Face safetensors checkpoint directory, headers validated, tensors read one at a time."""

    def __init__(self, hf_dir: Union[str, Path]):
        self.dir = Path(hf_dir)
        self.config, self.config_path = read_hf_config(self.dir)
        index_path, single = self.dir / INDEX_NAME, self.dir / SINGLE_NAME
        weight_map: Optional[dict[str, str]] = None
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{index_path}: not valid JSON ({exc})") from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index_path}: no weight_map object of tensor name -> shard file")
            files = sorted(set(weight_map.values()))
            for fname in files:
                check_shard_name(fname, index_path)
                if not (self.dir / fname).is_file():
                    example = next(k for k, v in weight_map.items() if v == fname)
                    raise ValueError(f"{index_path}: shard {fname} (holding {example!r}) does not exist in {self.dir}")
            self.index_path: Optional[Path] = index_path
        elif single.is_file():
            files = [SINGLE_NAME]
            self.index_path = None
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            bins = sorted(p.name for p in self.dir.glob("*.bin"))
            if shards:
                listed = ", ".join(shards[:3]) + (f" and {len(shards) - 3} more" if len(shards) > 3 else "")
                hint = (f": it holds {listed} but no {INDEX_NAME} naming which tensor is in which file; copy the "
                        f"index from where the checkpoint came from (a single file must be named {SINGLE_NAME})")
            elif bins:
                hint = (f" ({', '.join(bins[:3])} are pickle files, which are never read: save the model with "
                        "safetensors, e.g. transformers' save_pretrained(..., safe_serialization=True))")
            else:
                hint = " (expected a Hugging Face checkpoint directory with safetensors weights)"
            raise ValueError(f"{self.dir}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
        self.files: list[str] = files
        self._readers: dict[str, TensorFile] = {}
        self.location: dict[str, tuple[int, TensorInfo]] = {}
        for i, fname in enumerate(files):
            reader = TensorFile(self.dir / fname)  # validates the header against the file size
            self._readers[fname] = reader
            for name, info in reader.tensors.items():
                if name in self.location:
                    other = files[self.location[name][0]]
                    raise ValueError(f"{self.dir}: tensor {name!r} is stored twice, in {other} and {fname}")
                if weight_map is not None and weight_map.get(name) != fname:
                    raise ValueError(f"{index_path}: tensor {name!r} is in {fname} but the index maps it to "
                                     f"{weight_map.get(name)!r}")
                self.location[name] = (i, info)
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.location:
                    raise ValueError(f"{index_path}: lists tensor {name!r} in {fname}, which does not hold it")

    # --------------------------------------------------------------------------- queries
    def where(self, name: str) -> str:
        return self.files[self.location[name][0]]

    def info(self, name: str) -> TensorInfo:
        return self.location[name][1]

    def position(self, name: str) -> tuple[int, int]:
        i, info = self.location[name]
        return i, info.begin

    def validate(self, expected: dict[str, tuple[int, ...]], *, tied: bool) -> None:
        """``ValueError`` naming every unknown, missing or mis-shaped tensor (and its file); non-float dtypes too."""
        names = {n for n in self.location if not n.endswith(IGNORED_HF_SUFFIXES)}
        unknown = sorted(n for n in names - set(expected) if not hf_tensor_not_imported(n, tied=tied))
        missing = sorted(set(expected) - names)
        if missing:
            raise ValueError(f"{self.dir}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                             f"(expected by config.json, {len(missing)} in all)")
        if unknown:
            raise ValueError(f"{self.dir}: unknown tensors {[f'{n} (in {self.where(n)})' for n in unknown[:8]]}"
                             f"{' ...' if len(unknown) > 8 else ''}: not part of a "
                             f"{self.config.get('architectures')} model of this config.json")
        if tied and "lm_head.weight" in names:
            expected = dict(expected, **{"lm_head.weight": expected["model.embed_tokens.weight"]})
        for name in sorted(names):
            info = self.info(name)
            if info.shape != tuple(expected[name]):
                raise ValueError(f"{self.dir}: tensor {name!r} (in {self.where(name)}) has shape {list(info.shape)}, "
                                 f"config.json implies {list(expected[name])}")
            if not info.dtype.is_floating_point:
                raise ValueError(f"{self.dir}: tensor {name!r} (in {self.where(name)}) has dtype {info.dtype}; "
                                 "only floating-point weights are converted")

    def read(self, name: str, out: Optional[torch.Tensor] = None, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        return self._readers[self.where(name)].read(name, out=out, rows=rows)

    def check_tied_head(self) -> None:
        """A tied model's checkpoint may still store ``lm_head.weight``: it must equal the embeddings."""
        if "lm_head.weight" in self.location:
            if not torch.equal(self.read("lm_head.weight"), self.read("model.embed_tokens.weight")):
                raise ValueError(f"{self.dir}: tie_word_embeddings is true but lm_head.weight (in "
                                 f"{self.where('lm_head.weight')}) differs from model.embed_tokens.weight")

    def close(self) -> None:
        for r in self._readers.values():
            r.close()


def resolve_mcore_dir(path: Union[str, Path]) -> Path:
    """The checkpoint directory ``mcore-to-hf --mcore PATH`` reads.

    ``PATH`` itself when it holds ``meta.json`` (a converted directory or a trainer checkpoint step
    directory ``RUN/checkpoints/step_XXXXXXXX``). A run directory ``RUN``, its ``RUN/checkpoints`` or the
    ``RUN/checkpoints/latest`` marker stand for the checkpoint ``latest`` names (the newest complete one,
    :func:`megatron_logra.checkpoint.store.latest_checkpoint`). ``ValueError`` naming the problem and what
    to pass instead when ``PATH`` does not exist, is a run directory without a complete checkpoint, or is
    none of these."""
    given = Path(path)
    if not given.exists():
        raise ValueError(f"--mcore {given} does not exist: give a directory written by `convert hf-to-mcore`, a "
                         "trainer checkpoint RUN/checkpoints/step_XXXXXXXX or a run directory RUN")
    if given.is_dir() and (given / "meta.json").is_file():
        return given
    run = None
    if given.is_file() and given.name == "latest" and given.parent.name == "checkpoints":
        run = given.parent.parent
    elif given.is_dir() and given.name == "checkpoints" and not (given / "checkpoints").is_dir():
        run = given.parent
    elif given.is_dir() and (given / "checkpoints").is_dir():
        run = given
    if run is None:
        if given.is_dir() and (given / "config.json").is_file() and any(given.glob("*.safetensors")):
            raise ValueError(f"--mcore {given} is a Hugging Face checkpoint (config.json and *.safetensors), already "
                             "in the format mcore-to-hf writes: `convert hf-to-mcore --hf` reads it")
        if given.is_dir() and ((given / "config.yaml").is_file() or (given / "metrics.jsonl").is_file()):
            raise ValueError(f"--mcore {given} is a run directory without checkpoints/: it saved no checkpoint (a "
                             "run saves one every train.save_interval steps and after its last step); nothing to "
                             "export")
        raise ValueError(f"--mcore {given}: no meta.json: not a converted megatron checkpoint (`convert hf-to-mcore` "
                         "output), a trainer checkpoint RUN/checkpoints/step_XXXXXXXX or a run directory RUN")
    from megatron_logra.checkpoint.store import latest_checkpoint

    # without latest, the newest complete step_* (with a warning); a CheckpointError (a ValueError) when latest
    # names a broken checkpoint; None when no complete checkpoint is there at all
    step = latest_checkpoint(run)
    if step is None:
        raise ValueError(f"--mcore {given}: the run {run} has no complete checkpoint ({run / 'checkpoints' / 'latest'} "
                         "is missing): nothing to export (a run saves a checkpoint every train.save_interval steps "
                         "and after its last step; this one stopped before its first save): export another run or "
                         "train this one again")
    logger.info("--mcore %s: exporting the run's latest checkpoint %s", given, step)
    return step


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
            self.kind = "converted"
        elif "step" in meta and isinstance(meta.get("config"), dict) and isinstance(meta["config"].get("model"), dict):
            from megatron_logra.checkpoint.store import read_meta

            self.cfg = model_config_from_json(meta["config"]["model"], f"{meta_path} (config.model)")
            read_meta(self.dir, checksums=verify)  # CheckpointError (a ValueError) naming a bad file
            # sharded (dist_checkpointing): global tensors, layers stacked along a leading axis
            self._dist: Optional[DistTensors] = DistTensors(self.dir / "dist")
            self.prefix = ""
            self.checksums = {}
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
            if verify and expected is not None:
                actual = sha256_file(path)
                if actual != expected:
                    raise ValueError(f"{path}: sha256 {actual[:16]}... does not match meta.json ({expected[:16]}...): "
                                     "the file is corrupt or was modified")
            self._readers[key] = TensorFile(path)
        return self._readers[key]

    def _trainer_key(self, entry: TensorPlan) -> tuple[str, Optional[int]]:
        """Global checkpoint key of ``entry`` and its index along the stacked-layer axis."""
        m = _LAYER.match(entry.name)
        if m is None:
            if entry.name == "output_layer.weight" and self._dist is not None and entry.name not in self._dist:
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

