"""``config.json``, tokenizer and generation-config sources of an mcore -> HF export.

Which ``config.json`` an export writes (:func:`config_source`), first that applies:

1. ``--hf-template DIR`` (``explicit``): its config.json, verbatim.
2. ``hf/`` of a converted checkpoint (``converted``): the source checkpoint's config.json.
3. A trainer checkpoint (``RUN/checkpoints/step_XXXXXXXX``) of a run started from ``model.hf_path``
   (read from the checkpoint's own config, ``meta.json`` ``config.model``) when that directory exists
   here and its config.json describes the same architecture (``run``): its config.json, verbatim, so
   ``max_position_embeddings``, token ids, ``rope_scaling`` etc. are the original model's.

   "Verbatim" but for the dtype: the ``torch_dtype`` / ``dtype`` fields the copied config.json has are
   set to the dtype of the exported tensors (:func:`written_dtype`, the dtype most are stored in; or
   ``--dtype``, which casts every tensor), e.g. a bf16 run started from an fp32 checkpoint (a notice names
   the change).
4. Otherwise (``generated``) :func:`generated_hf_config`: built from the model config, with the fields
   serving stacks need — ``architectures`` (vLLM refuses a config without it), a top-level ``rope_theta``
   (transformers 4.x reads only that one and would silently use 10000), ``torch_dtype`` next to
   ``dtype`` — and bos / eos / pad ids of the run's tokenizer; a warning names the fields that may differ
   from the original checkpoint (``max_position_embeddings`` is the training ``seq_length``).

Tokenizer files of a trainer checkpoint come from ``RUN/tokenizer`` (written by the job with
``save_pretrained``: the tokenizer the model was trained with) when present, else from the config
source; ``generation_config.json`` from the config source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_logra.convert.hf_checkpoint import HF_EXTRA_FILES
from megatron_logra.convert.mcore_checkpoint import McoreCheckpoint
from megatron_logra.convert.hf_config import check_same_architecture, model_config_from_hf_dict_strict
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.presets import read_json_object

logger = logging.getLogger(__name__)

__all__ = ["ConfigSource", "config_source", "written_dtype", "generated_hf_config", "run_dir_of", "run_tokenizer_dir",
           "tokenizer_special_ids", "copy_files", "copy_export_extras", "GENERATION_CONFIG", "TOKENIZER_FILES"]

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = tuple(n for n in HF_EXTRA_FILES if n != GENERATION_CONFIG)
"""The tokenizer files an export copies (those a ``--force`` re-export recognises as its own)."""


@dataclass(frozen=True)
class ConfigSource:
    """Where an export's config.json and extra files come from."""

    kind: str
    """``explicit`` (--hf-template), ``converted`` (hf/ of a converted checkpoint), ``run`` (the run's
    ``model.hf_path``) or ``generated`` (no directory: config.json built from the model config)."""
    dir: Optional[Path]
    """The directory of config.json, generation_config.json and (without ``RUN/tokenizer``) the tokenizer
    files; when generated, ``hf/`` of a converted checkpoint that has one, else None."""
    config_text: Optional[str]
    """The config.json text to write verbatim (None when generated)."""


def run_dir_of(src: McoreCheckpoint) -> Optional[Path]:
    """``RUN`` of a trainer checkpoint ``RUN/checkpoints/step_XXXXXXXX``; None for other checkpoints."""
    if src.kind != "trainer":
        return None
    step = src.dir.resolve()
    return step.parent.parent if step.parent.name == "checkpoints" else None


def run_tokenizer_dir(src: McoreCheckpoint) -> Optional[Path]:
    """``RUN/tokenizer`` of a trainer checkpoint when it exists."""
    run = run_dir_of(src)
    if run is None or not (run / "tokenizer").is_dir():
        return None
    return run / "tokenizer"


def _checked_config(directory: Path, cfg: ModelConfig) -> str:
    """config.json text of ``directory``; ValueError unless it describes ``cfg``'s architecture (read at
    ``cfg.seq_length``, the checkpoint's: a sliding window no sequence of the run reached past is accepted, as
    when the run started from it)."""
    path = directory / "config.json"
    hf_cfg = model_config_from_hf_dict_strict(read_json_object(path), source=str(path), base=cfg)
    check_same_architecture(cfg, hf_cfg, str(path))
    return path.read_text()


def written_dtype(src: McoreCheckpoint) -> torch.dtype:
    """The dtype that holds most of ``src``'s parameters, as stored (read from file headers / checkpoint
    metadata): the dtype an export writes them in."""
    from megatron_logra.convert.tensor_plan import megatron_plan

    counts: dict[torch.dtype, int] = {}
    for entry in megatron_plan(src.cfg, src.tp, src.pp):
        dtype = src.dtype(entry)
        counts[dtype] = counts.get(dtype, 0) + int(torch.Size(entry.shape).numel())
    return max(counts, key=counts.get)


def _with_dtype(text: str, dtype: torch.dtype, where: Path) -> str:
    """config.json ``text`` whose ``torch_dtype`` / ``dtype`` fields (those present) name ``dtype``; the text
    unchanged when they already do (or it has neither)."""
    data = json.loads(text)
    name = str(dtype).replace("torch.", "")
    changed = {k: data[k] for k in ("torch_dtype", "dtype") if k in data and data[k] != name}
    if not changed:
        return text
    data.update({k: name for k in changed})
    logger.info("%s: %s set to %s in the exported config.json, the dtype of the exported tensors", where,
                ", ".join(f"{k}={v!r}" for k, v in changed.items()), name)
    return json.dumps(data, indent=2) + "\n"


def config_source(src: McoreCheckpoint, template: Optional[Path], dtype: Optional[torch.dtype] = None) -> ConfigSource:
    """The config.json source of exporting ``src`` (module docstring); logs which one is used. A copied
    config.json's ``torch_dtype`` / ``dtype`` name ``dtype``, the dtype of the exported tensors (by default
    :func:`written_dtype`).

    An explicit ``template`` without config.json, or whose config.json is of another architecture, is a
    ValueError; the run's ``model.hf_path`` is only used when it exists and matches (else a warning)."""
    source = _config_source(src, template)
    if source.config_text is None:
        return source
    assert source.dir is not None
    text = _with_dtype(source.config_text, dtype or written_dtype(src), source.dir / "config.json")
    return dataclasses.replace(source, config_text=text)


def _config_source(src: McoreCheckpoint, template: Optional[Path]) -> ConfigSource:
    cfg = src.cfg
    if template is not None:
        if not (template / "config.json").is_file():
            raise ValueError(f"--hf-template {template}: no config.json")
        try:
            text = _checked_config(template, cfg)
        except ValueError as exc:
            raise ValueError(f"--hf-template {template} is not a template of this checkpoint ({src.dir}): {exc}; pass "
                             "the Hugging Face directory of the model the checkpoint was converted from or trained "
                             "from, or leave --hf-template out") from None
        logger.info("config.json from the template %s (--hf-template)", template)
        return ConfigSource("explicit", template, text)
    converted = src.hf_files_dir
    if converted is not None and (converted / "config.json").is_file():
        text = _checked_config(converted, cfg)
        logger.info("config.json from %s (the source checkpoint's, kept by hf-to-mcore)", converted)
        return ConfigSource("converted", converted, text)
    if src.kind == "trainer" and cfg.hf_path:
        hf_path = Path(cfg.hf_path)
        if (hf_path / "config.json").is_file():
            try:
                text = _checked_config(hf_path, cfg)
            except ValueError as exc:
                logger.warning("the run's model.hf_path %s is not used as the export template: %s", hf_path, exc)
            else:
                logger.info("config.json from the run's model.hf_path %s (the checkpoint it started from; "
                            "--hf-template DIR overrides)", hf_path)
                return ConfigSource("run", hf_path, text)
        else:
            logger.warning("the run's model.hf_path %s has no config.json here: it cannot serve as the export "
                           "template", hf_path)
    logger.warning("%s: no Hugging Face template (--hf-template DIR, hf/ of a converted checkpoint or the run's "
                   "model.hf_path): config.json is generated from the model config; fields that may differ from "
                   "the original checkpoint: max_position_embeddings (= training seq_length %d), the RoPE parameters "
                   "(rope_theta and a Llama 3 scaling factor only), bos/eos/pad token ids (the run's tokenizer's, if any), no generation_config.json; pass "
                   "--hf-template with the original checkpoint to keep its config", src.dir, cfg.seq_length)
    return ConfigSource("generated", converted, None)


def tokenizer_special_ids(tokenizer_dir: Optional[Path]) -> dict[str, Optional[int]]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the tokenizer saved in ``tokenizer_dir``
    (empty when there is none or it cannot be loaded: a warning)."""
    if tokenizer_dir is None:
        return {}
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as exc:  # any loading failure only costs the token ids
        logger.warning("tokenizer %s could not be loaded (%s: %s): config.json gets no bos/eos/pad token ids",
                       tokenizer_dir, type(exc).__name__, exc)
        return {}
    return {name: getattr(tok, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def generated_hf_config(cfg: ModelConfig, dtype: torch.dtype,
                        special_ids: Optional[dict[str, Optional[int]]] = None) -> dict:
    """A servable config.json of ``cfg``'s model whose weights are stored in ``dtype``.

    The SGLang engine's config (:func:`megatron_logra.rollout.sglang_api.engine_hf_config`: the HF class
    in ``architectures``, a top-level ``rope_theta``, ``torch_dtype``) at the unpadded vocabulary, with
    ``max_position_embeddings`` = ``seq_length``, ``dtype`` = ``torch_dtype`` = ``dtype`` and the token ids
    of ``special_ids``."""
    from megatron_logra.rollout.sglang_api import engine_hf_config

    data = engine_hf_config(dataclasses.replace(cfg, make_vocab_size_divisible_by=1), tp=1)
    name = str(dtype).replace("torch.", "")
    data["vocab_size"] = cfg.vocab_size
    data["max_position_embeddings"] = cfg.seq_length
    data["dtype"] = name
    data["torch_dtype"] = name
    for key, value in (special_ids or {}).items():
        if value is not None:
            data[key] = int(value)
    data.pop("transformers_version", None)
    return data


def copy_files(src: Optional[Path], dst: Path, names: tuple[str, ...]) -> list[str]:
    """Copy the files ``names`` that exist in ``src`` into ``dst`` (created when one does); returns the
    names copied."""
    copied: list[str] = []
    if src is None:
        return copied
    for name in names:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def copy_export_extras(source: ConfigSource, tokenizer_dir: Optional[Path], dst: Path) -> list[str]:
    """generation_config.json of the config source; tokenizer files of the run (``RUN/tokenizer``: the
    tokenizer the model was trained with) when it has one, else of the config source (never a mix)."""
    copied = copy_files(source.dir, dst, (GENERATION_CONFIG,))
    if tokenizer_dir is not None:
        from_run = copy_files(tokenizer_dir, dst, TOKENIZER_FILES)
        skipped = sorted(p.name for p in tokenizer_dir.iterdir() if p.name not in from_run)
        logger.info("tokenizer files from the run's %s: %s%s", tokenizer_dir, from_run,
                    f" (not copied: {skipped})" if skipped else "")
        return copied + from_run
    return copied + copy_files(source.dir, dst, TOKENIZER_FILES)
