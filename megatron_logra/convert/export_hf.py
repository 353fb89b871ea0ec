"""megatron-core -> Hugging Face export (``megatron-logra convert mcore-to-hf``), streaming.

Owns :func:`convert_mcore_to_hf`: reading a converted directory or a trainer checkpoint one full parameter at
a time, splitting it into its HF tensors and appending them to safetensors shards whose headers are computed up
front; the shard assignment (a template's index, else greedy up to ``max_shard_size``: :func:`parse_size`), the
tied-embedding check across pipeline stages, and the index, config and tokenizer files written beside them.
The design both directions share (memory bound, outputs built aside) is described in
:mod:`megatron_logra.convert.convert`, from which these names stay importable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_logra.convert.combine import split_to_hf
from megatron_logra.convert.export_config import (
    config_source,
    copy_export_extras,
    generated_hf_config,
    run_tokenizer_dir,
    tokenizer_special_ids,
    written_dtype,
)
from megatron_logra.convert.hf_checkpoint import INDEX_NAME, SINGLE_NAME, hf_tensor_not_imported
from megatron_logra.convert.mcore_checkpoint import McoreCheckpoint
from megatron_logra.convert.mcore_path import earlier_export_hint, resolve_mcore_dir
from megatron_logra.convert.outdir import EXPORT_MARK, _finalize, _prepare_out, _write_json, template_weight_map
from megatron_logra.convert.st_io import SafetensorsWriter
from megatron_logra.convert.tensor_plan import hf_expected_shapes, megatron_plan

logger = logging.getLogger(__name__)

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


def _with_earlier_hint(exc: ValueError, mcore_dir: Path) -> ValueError:
    """``exc`` with :func:`earlier_export_hint` appended, as a ``CheckpointError`` when it was one."""
    from megatron_logra.checkpoint.integrity import CheckpointError

    message = f"{exc}{earlier_export_hint(mcore_dir)}"
    return CheckpointError(message) if isinstance(exc, CheckpointError) else ValueError(message)


def convert_mcore_to_hf(
    mcore_dir: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    hf_template: Optional[Union[str, Path]] = None,
    max_shard_size: Union[str, int] = "5GB",
    force: bool = False,
    verify: bool = True,
    dtype: Optional[torch.dtype] = None,
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

    Tensors are written in the dtype they are stored in (a bf16 run's fp32 norm weights stay fp32; config.json
    names the dtype of most parameters), or all in ``dtype`` when given (``--dtype``), as ``save_pretrained``
    of a model in that dtype writes them. Every shard's ``__metadata__`` carries
    :data:`~megatron_logra.convert.outdir.EXPORT_MARK`, by which ``force`` tells an earlier export it may replace.
    """
    t0 = time.perf_counter()
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype: give bfloat16, float16 or float32")
    mcore_dir, out_dir = resolve_mcore_dir(mcore_dir), Path(out_dir)
    template = Path(hf_template) if hf_template else None
    max_bytes = parse_size(max_shard_size)
    try:
        src = McoreCheckpoint(mcore_dir, verify=verify)
    except ValueError as exc:  # a damaged meta.json: name the checkpoint to export instead
        raise _with_earlier_hint(exc, mcore_dir) from exc
    try:
        cfg, tp, pp = src.cfg, src.tp, src.pp
        plan = megatron_plan(cfg, tp, pp)
        try:
            src.validate(plan, verify=verify)
        except ValueError as exc:  # a truncated or corrupt file (its size or CRC-32), a missing tensor
            raise _with_earlier_hint(exc, mcore_dir) from exc
        tied = not cfg.untie_embeddings_and_output_weights

        # config.json (and the files that travel with it): see export_config
        stored = written_dtype(src)
        source = config_source(src, template, dtype or stored)
        config_text = source.config_text
        tokenizer_dir = run_tokenizer_dir(src)  # RUN/tokenizer of a trainer checkpoint: its files win
        special_ids = tokenizer_special_ids(tokenizer_dir) if config_text is None else {}

        # the HF tensors, in processing order (megatron stage order), with shapes and dtypes
        expected = hf_expected_shapes(cfg)
        sources = [e for e in plan if not (tied and e.name == "output_layer.weight")]
        hf_entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for e in sources:
            e_dtype = dtype or src.dtype(e)  # from file headers / checkpoint metadata: no tensor is read
            for name in e.sources:
                hf_entries.append((name, e_dtype, tuple(expected[name])))
        others = sorted({str(d).replace("torch.", "") for _, d, _ in hf_entries if d != stored})
        if others:
            logger.info("writing tensors as stored: most are %s (config.json says so), some %s (e.g. norm weights "
                        "kept in fp32); --dtype %s writes all in one dtype", str(stored).replace("torch.", ""),
                        others, str(stored).replace("torch.", ""))
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

        tmp = _prepare_out(out_dir, force, (mcore_dir, source.dir, template, tokenizer_dir), export=True)
        writers: dict[str, SafetensorsWriter] = {}
        try:
            for fname in file_names:
                entries = [x for x in hf_entries if assignment[x[0]] == fname]
                writers[fname] = SafetensorsWriter(tmp / fname, entries, metadata={"format": "pt", EXPORT_MARK[0]: EXPORT_MARK[1]})
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
                    w.write(name, tensor.to(dtype or tensor.dtype).contiguous())
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
                generated = generated_hf_config(cfg, dtype or stored, special_ids)
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
