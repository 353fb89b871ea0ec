"""HF <-> megatron-core checkpoint conversion, streaming.

``convert_hf_to_mcore(hf_dir, out_dir, tp=, pp=)`` writes ``model_tp{t}_pp{p}.safetensors`` per
model-parallel rank (exactly the parameters, names and TP shards ``build_gpt`` holds on that rank;
vocabulary rows zero-padded to ``ModelConfig.padded_vocab_size(tp)``), ``hf/`` (the source
``config.json``, tokenizer files and ``generation_config.json``) and ``meta.json`` (format version,
model config, tp, pp, source architecture, sha256 / size / tensor count per file), written last.

``convert_mcore_to_hf(mcore_dir, out_dir, hf_template=None)`` (in :mod:`megatron_logra.convert.export_hf`, importable
from here) reads such a directory (or a trainer
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
import logging
import shutil
import time
from pathlib import Path
from typing import Optional, Union

from megatron_logra.convert.combine import build_full
from megatron_logra.convert.export_config import copy_files
from megatron_logra.convert.export_hf import convert_mcore_to_hf, parse_size
from megatron_logra.convert.hf_checkpoint import HF_EXTRA_FILES, HFCheckpoint
from megatron_logra.convert.hf_config import model_config_from_hf_dict_strict
from megatron_logra.convert.mcore_checkpoint import MCORE_FORMAT, MCORE_FORMAT_VERSION, rank_file_name
from megatron_logra.convert.outdir import _finalize, _prepare_out, _write_json
from megatron_logra.convert.st_io import SafetensorsWriter
from megatron_logra.convert.tensor_plan import hf_expected_shapes, megatron_plan, shard, shard_shape

logger = logging.getLogger(__name__)

__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf", "parse_size"]  # the last two live in convert.export_hf


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
        cfg = model_config_from_hf_dict_strict(ckpt.config, source=str(ckpt.config_path),
                                               seq_field="max_position_embeddings")
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

        tmp = _prepare_out(out_dir, force, (hf_dir,), mcore=True)
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
