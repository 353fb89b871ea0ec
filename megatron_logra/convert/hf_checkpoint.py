"""Reader of a Hugging Face checkpoint directory, the source of an import and the template of an export.

:class:`HFCheckpoint` — a Hugging Face directory: ``config.json`` plus ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. Every shard's header is read and validated on
open (truncation, offsets, the index agreeing with the files); tensors are then read one at a
time. ``pytorch_model.bin`` is never read (no pickle). A directory holding both ``model.safetensors`` and an
index naming other shards (two saves of the weights) is refused: transformers reads the single file, loaders
that follow the index the shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_logra.convert.hf_config import read_hf_config
from megatron_logra.convert.st_io import TensorFile, TensorInfo
from megatron_logra.convert.tensor_plan import IGNORED_HF_SUFFIXES

__all__ = ["HFCheckpoint", "HF_EXTRA_FILES", "INDEX_NAME", "SINGLE_NAME", "check_shard_name",
           "hf_tensor_not_imported"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HF_EXTRA_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
"""Files copied alongside the weights when present (tokenizer and generation config)."""


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
            if single.is_file() and files != [SINGLE_NAME]:
                # save_pretrained of a sharded model into a directory holding a single-file save (or the other
                # way round) leaves the other one behind; readers disagree on which one is the model
                raise ValueError(
                    f"{self.dir}: holds both {SINGLE_NAME} and {INDEX_NAME} (naming {len(files)} shard "
                    f"files), two different saves of the weights: transformers' from_pretrained reads "
                    f"{SINGLE_NAME} and ignores the index, loaders that follow the index read the shards. One is "
                    f"left over from an earlier save_pretrained into this directory: remove it ({SINGLE_NAME}, or "
                    f"{INDEX_NAME} and its shards), or save the model into an empty directory")
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
