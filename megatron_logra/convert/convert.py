"""HF <-> megatron-core checkpoint conversion, streaming.

``convert_hf_to_mcore(hf_dir, out_dir, tp=, pp=)`` writes ``model_tp{t}_pp{p}.safetensors`` per
model-parallel rank (exactly the parameters, names and TP shards ``build_gpt`` holds on that rank;
vocabulary rows zero-padded to ``ModelConfig.padded_vocab_size(tp)``), ``hf/`` (the source
``config.json``, tokenizer files and ``generation_config.json``) and ``meta.json`` (format version,
model config, tp, pp, source architecture, sha256 / size / tensor count per file), written last.

``convert_mcore_to_hf(mcore_dir, out_dir, hf_template=None)`` reads such a directory (or a trainer
checkpoint step directory, or a run directory for its latest checkpoint) and writes a Hugging Face
checkpoint: ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (the template's shard assignment when it has one, else greedy up to
``max_shard_size``), ``config.json`` and the
tokenizer / generation-config files of the template (else of ``mcore_dir/hf``; for a trainer
checkpoint, of the run's ``model.hf_path`` when it exists, else a generated, servable config.json;
tokenizer files of ``RUN/tokenizer`` when the run saved one: :mod:`megatron_logra.convert.export_config`).

Memory bound. No file is ever loaded whole: tensors are read one by one (``seek`` + ``readinto``),
HF parts straight into their rows of the fused megatron tensor (``[gate; up]``, the unpadded
vocabulary rows), and written out as TP shards appended to output files whose headers were computed
up front from the config (safetensors needs every shape before the first byte). Peak memory is about
one full megatron parameter plus one TP shard or one q/k/v part of it (≤ 2× the largest single
parameter, e.g. ``[2·ffn, hidden]`` for ``linear_fc1`` or ``[padded vocab, hidden]`` for the
embeddings), independent of the number and size of the HF shards; mcore -> HF likewise holds one
full parameter plus one rank's shard. A trainer checkpoint (layers stacked along a leading axis) is
read one layer slice of one key at a time, only that slice's stored chunks, so every stored byte is
read once whatever the number of layers (``tests/unit/test_convert_trainer_reads.py`` counts them).
``test_conversion_streams_one_parameter_at_a_time`` (``tests/unit/test_convert.py``) checks the live
tensor bytes of both directions; ``benchmarks/convert_memory.py`` prints their peak RSS. Inputs are processed in storage order (HF: shard, then
offset), so disks read sequentially.

Outputs are built in a sibling ``.NAME.partial`` directory and renamed onto ``out_dir`` at the
end (a previous output is first renamed aside to ``.NAME.old``, deleted after the swap; a swap killed
midway is finished by the next conversion to ``out_dir``: :mod:`megatron_logra.convert.outdir`); an existing non-empty ``out_dir`` is replaced only with ``force=True`` and only when it
looks like a checkpoint (has ``meta.json`` or ``config.json``). ``out_dir`` must be apart from every
input (not one, not inside one, not holding one), with or without ``force``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_logra.convert.combine import build_full, split_to_hf
from megatron_logra.convert.export_config import (
    config_source,
    copy_export_extras,
    copy_files,
    generated_hf_config,
    run_tokenizer_dir,
    tokenizer_special_ids,
)
from megatron_logra.convert.hf_checkpoint import (
    HF_EXTRA_FILES,
    INDEX_NAME,
    SINGLE_NAME,
    HFCheckpoint,
    hf_tensor_not_imported,
)
from megatron_logra.convert.hf_config import model_config_from_hf_dict_strict
from megatron_logra.convert.mcore_checkpoint import MCORE_FORMAT, MCORE_FORMAT_VERSION, McoreCheckpoint, rank_file_name
from megatron_logra.convert.mcore_path import resolve_mcore_dir
from megatron_logra.convert.outdir import _finalize, _prepare_out, template_weight_map
from megatron_logra.convert.st_io import SafetensorsWriter
from megatron_logra.convert.tensor_plan import hf_expected_shapes, megatron_plan, shard, shard_shape

logger = logging.getLogger(__name__)

__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: Union[str, int]) -> int:
    """``"5GB"`` (10⁹, as transformers), ``"500MiB"`` (2²⁰) or a byte count."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
        if not m:
            raise ValueError(f"max_shard_size={text!r}: give bytes or a size like 5GB, 500MB, 2GiB")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise ValueError(f"max_shard_size={text!r} must be positive")
    return value


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


# ------------------------------------------------------------------------------ HF -> megatron-core
def convert_hf_to_mcore(
    hf_dir: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    tp: int = 1,
    pp: int = 1,
    make_vocab_size_divisible_by: Optional[int] = None,
    force: bool = False,
) -> dict:
    """Convert the HF checkpoint ``hf_dir`` to per-rank megatron-core files at ``(tp, pp)``; returns meta.json."""
    t0 = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    ckpt = HFCheckpoint(hf_dir)
    try:
        cfg = model_config_from_hf_dict_strict(ckpt.config, source=str(ckpt.config_path))
        if make_vocab_size_divisible_by is not None:
            if make_vocab_size_divisible_by < 1:
                raise ValueError(f"make_vocab_size_divisible_by={make_vocab_size_divisible_by} must be >= 1")
            cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        tied = not cfg.untie_embeddings_and_output_weights
        plan = megatron_plan(cfg, tp, pp)
        ckpt.validate(hf_expected_shapes(cfg), tied=tied)
        if tied:
            ckpt.check_tied_head()
        dtypes = {}
        for e in plan:
            found = {ckpt.info(s).dtype for s in e.sources}
            if len(found) > 1:
                raise ValueError(f"{hf_dir}: HF tensors {list(e.sources)} have different dtypes "
                                 f"{sorted(map(str, found))}; they are fused into {e.name}")
            dtypes[e] = found.pop()
        order = sorted(plan, key=lambda e: min(ckpt.position(s) for s in e.sources))

        tmp = _prepare_out(out_dir, force, (hf_dir,))
        writers: dict[tuple[int, int], SafetensorsWriter] = {}
        try:
            for p in range(pp):
                stage = [e for e in order if e.pp_rank == p]
                for t in range(tp):
                    entries = [(e.local_name, dtypes[e], shard_shape(e.shape, e.partition, tp)) for e in stage]
                    writers[(t, p)] = SafetensorsWriter(tmp / rank_file_name(t, p), entries,
                                                        metadata={"format": "pt", "tp_rank": str(t), "pp_rank": str(p)})
            for e in order:
                full = build_full(e, ckpt.read, cfg, dtypes[e])
                for t in range(tp):
                    writers[(t, e.pp_rank)].write(e.local_name, shard(full, e.partition, t, tp))
                del full
            files = {}
            for (t, p), w in sorted(writers.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                files[rank_file_name(t, p)] = {"tp_rank": t, "pp_rank": p, **w.close()}
            copied = copy_files(hf_dir, tmp / "hf", ("config.json",) + HF_EXTRA_FILES)
            archs = ckpt.config.get("architectures") or []
            meta = {
                "format": MCORE_FORMAT,
                "format_version": MCORE_FORMAT_VERSION,
                "model_config": dataclasses.asdict(cfg),
                "tp": tp,
                "pp": pp,
                "padded_vocab_size": cfg.padded_vocab_size(tp),
                "vocab_padding": "zeros",
                "source": {
                    "kind": "hf",
                    "architecture": archs[0] if archs else None,
                    "model_type": ckpt.config.get("model_type"),
                    "path": str(hf_dir.resolve()),
                    "num_files": len(ckpt.files),
                    "dtypes": sorted({str(d).replace("torch.", "") for d in dtypes.values()}),
                    "copied_files": copied,
                },
                "files": files,
            }
            _write_json(tmp / "meta.json", meta)  # last: a directory without it is incomplete
            _finalize(tmp, out_dir)
        except BaseException:
            for w in writers.values():
                w.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        ckpt.close()
    logger.info("converted %s -> %s (tp=%d pp=%d, %d tensors) in %.1fs", hf_dir, out_dir, tp, pp, len(plan),
                time.perf_counter() - t0)
    return meta


# ------------------------------------------------------------------------------ megatron-core -> HF
def _plan_shards(names: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in names:
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def convert_mcore_to_hf(
    mcore_dir: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    hf_template: Optional[Union[str, Path]] = None,
    max_shard_size: Union[str, int] = "5GB",
    force: bool = False,
    verify: bool = True,
) -> dict:
    """Convert per-rank megatron-core files (converter output or a trainer checkpoint) to an HF checkpoint.

    ``hf_template``: an HF directory of the same architecture whose ``config.json``, tokenizer files and
    shard assignment (``model.safetensors.index.json``) are reused. Index entries that HF -> megatron-core
    skips too (a tied model's ``lm_head.weight``, ``rotary_emb.inv_freq`` buffers:
    :func:`~megatron_logra.convert.hf_checkpoint.hf_tensor_not_imported`) are not written, and a template
    shard that held only such entries is not written (the other shards keep the template's file names). Without one, the config source is
    ``mcore_dir/hf``, a trainer run's ``model.hf_path`` or a generated config.json
    (:func:`megatron_logra.convert.export_config.config_source`). A trainer checkpoint's tokenizer files
    come from ``RUN/tokenizer`` (the tokenizer it was trained with) when the run saved one, even with a
    template. ``verify=False`` skips the checksum pass over the input: the sha256 of a converted directory's
    rank files, the CRC-32 of every file of a trainer checkpoint (its ``meta.json`` and the file sizes are
    still checked). ``mcore_dir`` may also be a run directory ``RUN`` (or ``RUN/checkpoints``, or its
    ``latest`` marker): its latest complete checkpoint is exported
    (:func:`~megatron_logra.convert.mcore_path.resolve_mcore_dir`). Returns the written index dict
    (``weight_map`` and ``metadata``; one file -> ``{"weight_map": ..., "metadata": ...}`` as well), the
    files written (``files``) and the checkpoint directory read (``mcore``).
    """
    t0 = time.perf_counter()
    mcore_dir, out_dir = resolve_mcore_dir(mcore_dir), Path(out_dir)
    template = Path(hf_template) if hf_template else None
    max_bytes = parse_size(max_shard_size)
    src = McoreCheckpoint(mcore_dir, verify=verify)
    try:
        cfg, tp, pp = src.cfg, src.tp, src.pp
        plan = megatron_plan(cfg, tp, pp)
        src.validate(plan, verify=verify)
        tied = not cfg.untie_embeddings_and_output_weights

        # config.json (and the files that travel with it): see export_config
        source = config_source(src, template)
        config_text = source.config_text
        tokenizer_dir = run_tokenizer_dir(src)  # RUN/tokenizer of a trainer checkpoint: its files win
        special_ids = tokenizer_special_ids(tokenizer_dir) if config_text is None else {}

        # the HF tensors, in processing order (megatron stage order), with shapes and dtypes
        expected = hf_expected_shapes(cfg)
        sources = [e for e in plan if not (tied and e.name == "output_layer.weight")]
        hf_entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for e in sources:
            dtype = src.dtype(e)  # from file headers / checkpoint metadata: no tensor is read
            for name in e.sources:
                hf_entries.append((name, dtype, tuple(expected[name])))
        itemsize = {d: torch.empty((), dtype=d).element_size() for _, d, _ in hf_entries}
        nbytes = {n: itemsize[d] * int(torch.Size(s).numel()) for n, d, s in hf_entries}

        # shard assignment
        template_index = template / INDEX_NAME if template is not None else None
        if template_index is not None and template_index.is_file():
            weight_map = template_weight_map(template_index)
            mine = {n for n, _, _ in hf_entries}
            skipped = sorted(n for n in weight_map if n not in mine and hf_tensor_not_imported(n, tied=tied))
            if skipped:  # what hf-to-mcore accepts and skips in this checkpoint is not written back either
                kept = {n: f for n, f in weight_map.items() if n not in skipped}
                dropped = sorted(set(weight_map.values()) - set(kept.values()))
                logger.info("%s: not writing %s (no model parameter comes from them)%s", template_index, skipped[:8],
                            f"; shards left empty are not written: {dropped}" if dropped else "")
                weight_map = kept
            if set(weight_map) != mine:
                extra, missing = sorted(set(weight_map) - mine), sorted(mine - set(weight_map))
                raise ValueError(f"{template_index}: its weight_map does not match this model: tensors not in the "
                                 f"model {extra[:8]}, tensors missing from the index {missing[:8]}")
            file_names = sorted(set(weight_map.values()))
            assignment = {n: weight_map[n] for n in mine}
            indexed = True  # the template's shard names need their index, also when one shard is left
        else:
            indexed = False
            groups = _plan_shards([(n, nbytes[n]) for n, _, _ in hf_entries], max_bytes)
            if template is not None and (template / SINGLE_NAME).is_file():
                groups = [[n for g in groups for n in g]]
            if len(groups) == 1:
                file_names = [SINGLE_NAME]
            else:
                file_names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
            assignment = {n: file_names[i] for i, g in enumerate(groups) for n in g}

        tmp = _prepare_out(out_dir, force, (mcore_dir, source.dir, template, tokenizer_dir))
        writers: dict[str, SafetensorsWriter] = {}
        try:
            for fname in file_names:
                entries = [x for x in hf_entries if assignment[x[0]] == fname]
                writers[fname] = SafetensorsWriter(tmp / fname, entries, metadata={"format": "pt"})
            results: dict[str, dict] = {}
            embedding_digest: Optional[str] = None
            for e in plan:
                full = src.read_full(e)
                if tied and e.name == "output_layer.weight":  # megatron's last-stage copy of the embeddings
                    digest = hashlib.sha256(full.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
                    if digest != embedding_digest:
                        raise ValueError(f"{mcore_dir}: tied embeddings, but output_layer.weight of stage {e.pp_rank} "
                                         "differs from embedding.word_embeddings.weight of stage 0")
                    continue
                if tied and e.name == "embedding.word_embeddings.weight" and pp > 1:
                    embedding_digest = hashlib.sha256(full.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
                for name, tensor in split_to_hf(e, full, cfg):
                    w = writers[assignment[name]]
                    w.write(name, tensor.contiguous())
                    del tensor
                    if w.done:
                        results[assignment[name]] = w.close()
                del full
            for fname, w in writers.items():
                if fname not in results:
                    results[fname] = w.close()
            weight_map = {n: assignment[n] for n in sorted(assignment)}
            index = {
                "metadata": {"total_size": sum(nbytes.values()),
                             "total_parameters": sum(int(torch.Size(s).numel()) for _, _, s in hf_entries)},
                "weight_map": weight_map,
            }
            if indexed or len(file_names) > 1:
                _write_json(tmp / INDEX_NAME, index)
            copied = copy_export_extras(source, tokenizer_dir, tmp)
            if config_text is None:
                generated = generated_hf_config(cfg, hf_entries[0][1], special_ids)
                config_text = json.dumps(generated, indent=2, sort_keys=True) + "\n"
            (tmp / "config.json").write_text(config_text)  # last
            _finalize(tmp, out_dir)
        except BaseException:
            for w in writers.values():
                w.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        src.close()
    logger.info("converted %s -> %s (%d files, %d tensors, extras %s) in %.1fs", mcore_dir, out_dir, len(file_names),
                len(hf_entries), copied, time.perf_counter() - t0)
    return {**index, "files": results, "mcore": str(mcore_dir)}
