"""The ``ModelConfig`` of a Hugging Face checkpoint: architecture from ``config.json``, run choices kept.

A model's fields split into :data:`ARCH_FIELDS` (read from the checkpoint, strictly checked by
:func:`~megatron_logra.convert.hf_checks.check_hf_config`) and :data:`TRAINING_FIELDS` (the run's own:
sequence length, dtype, recompute, ...). :func:`check_same_architecture` compares a run's model with a
checkpoint's field by field, so a mismatch is named instead of surfacing as a tensor shape error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Optional, Union

from megatron_logra.convert.hf_checks import check_hf_config
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import _check_supported
from megatron_logra.models.presets import model_config_from_hf_dict, read_json_object

__all__ = ["TRAINING_FIELDS", "ARCH_FIELDS", "model_config_from_hf_dict_strict", "read_hf_config",
           "model_config_from_hf", "check_same_architecture", "model_config_from_json"]

TRAINING_FIELDS = ("seq_length", "params_dtype", "recompute", "hidden_dropout", "attention_dropout", "init_std",
                   "make_vocab_size_divisible_by", "hf_path",
                   "transformer_impl", "fp8", "fp8_recipe", "sequence_parallel")
"""ModelConfig fields a run chooses; everything else (:data:`ARCH_FIELDS`) comes from the HF config."""
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in TRAINING_FIELDS)


def model_config_from_hf_dict_strict(raw: dict, *, source: str = "config.json", base: Optional[ModelConfig] = None,
                                     seq_length: Optional[int] = None,
                                     seq_field: str = "model.seq_length") -> ModelConfig:
    """:func:`check_hf_config`, then the presets loader, then the HF-mapping support check.

    Architecture fields come from ``raw``; :data:`TRAINING_FIELDS` from ``base`` when given
    (else ``seq_length`` = ``max_position_embeddings``, dtype from the config, ModelConfig defaults).
    ``seq_field`` names the sequence length in a sliding-window refusal (``max_position_embeddings`` for
    ``hf-to-mcore``, which has no run).
    """
    run_length = base.seq_length if base is not None else seq_length
    if run_length is None:  # the model's own context, as below
        mpe = raw.get("max_position_embeddings")
        run_length = mpe if isinstance(mpe, int) and not isinstance(mpe, bool) else None
    check_hf_config(raw, source, seq_length=run_length, seq_field=seq_field)
    if seq_length is None and base is None:
        mpe = raw.get("max_position_embeddings")
        if "max_position_embeddings" in raw and (not isinstance(mpe, int) or isinstance(mpe, bool) or mpe < 1):
            raise ValueError(f"{source}: max_position_embeddings={mpe!r} must be a positive integer")
        seq_length = mpe
    cfg = model_config_from_hf_dict(raw, seq_length=seq_length, source=source)
    if base is not None:
        cfg = replace(cfg, **{k: getattr(base, k) for k in TRAINING_FIELDS})
    try:
        _check_supported(cfg)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return cfg


def read_hf_config(hf_dir: Union[str, Path]) -> tuple[dict, Path]:
    """``(config.json's object, its path)`` of the Hugging Face checkpoint directory ``hf_dir``. ``ValueError``
    when ``hf_dir`` is no directory or has no ``config.json``; for a directory this project wrote instead (a
    ``convert hf-to-mcore`` output, a run directory or one of its checkpoints) the error says what it is and
    which Hugging Face directory to give (:func:`_not_hf_hint`)."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ValueError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint directory)")
    if not path.is_file():
        raise ValueError(f"{hf_dir}: no config.json (expected a Hugging Face checkpoint directory)"
                         f"{_not_hf_hint(hf_dir)}")
    return read_json_object(path), path


def _not_hf_hint(hf_dir: Union[str, Path]) -> str:
    """What to give instead of ``hf_dir``, a directory without ``config.json``, when this project wrote it: for a
    ``convert hf-to-mcore`` output (its ``meta.json`` names the source) the Hugging Face directory it was converted
    from; for a run directory or a trainer checkpoint, ``convert mcore-to-hf`` to export it first. ``""`` for
    anything else."""
    directory = Path(hf_dir)
    meta: object = None
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        pass
    if isinstance(meta, dict) and meta.get("format") == "megatron_logra.mcore":
        source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
        origin = f"{source['path']}; " if isinstance(source.get("path"), str) else ""
        return (f"; it is a megatron-core conversion written by `megatron-logra convert hf-to-mcore` (meta.json, "
                f"model_tp*_pp*.safetensors), not a Hugging Face checkpoint: give the Hugging Face directory it was "
                f"converted from ({origin}training shards it to its own TP / PP as it loads)")
    checkpoint = isinstance(meta, dict) and "step" in meta
    run_dir = (directory / "config.yaml").is_file() and (directory / "checkpoints").is_dir()
    if checkpoint or run_dir:
        return (f"; it is a run directory or checkpoint of this trainer: export it first with `megatron-logra convert "
                f"mcore-to-hf --mcore {hf_dir} --out HF_DIR` and give HF_DIR (or continue the run with "
                f"`megatron-logra train --resume RUN_DIR`)")
    return ""


def model_config_from_hf(hf_dir: Union[str, Path], base: Optional[ModelConfig] = None) -> ModelConfig:
    """``ModelConfig`` of the HF checkpoint in ``hf_dir`` (strictly checked, see :func:`check_hf_config`).

    Architecture fields (layers, widths, heads, groups, vocabulary, biases, q/k norm, tying, RoPE
    base, norm epsilon) come from ``config.json``. With ``base`` the run's own choices
    (:data:`TRAINING_FIELDS`: sequence length, dtype, recompute, dropout, init std, vocabulary
    padding multiple, layer implementation, FP8, sequence parallelism) are kept from it; without, ``seq_length`` is ``max_position_embeddings`` and
    the dtype is the checkpoint's. ``hf_path`` is set to ``hf_dir`` made absolute (against the working
    directory, symlinks kept), so a run's saved config names the checkpoint wherever it is resumed or exported.
    """
    if not str(hf_dir) or not Path(hf_dir).is_dir():
        raise ValueError(f"model.hf_path={str(hf_dir)!r} is not a directory (expected a Hugging Face checkpoint)")
    try:
        raw, path = read_hf_config(hf_dir)
    except ValueError as exc:
        raise ValueError(f"model.hf_path={str(hf_dir)!r}: {exc}") from None
    cfg = model_config_from_hf_dict_strict(raw, source=str(path), base=base)
    return replace(cfg, hf_path=os.path.abspath(hf_dir))


def check_same_architecture(cfg: ModelConfig, hf_cfg: ModelConfig, what: str) -> None:
    """``ValueError`` naming every architecture field where ``cfg`` differs from the checkpoint's ``hf_cfg``."""
    diff = [f"model.{k}={getattr(cfg, k)!r} but {what} has {getattr(hf_cfg, k)!r}"
            for k in ARCH_FIELDS if getattr(cfg, k) != getattr(hf_cfg, k)]
    if diff:
        raise ValueError("the model config does not match the checkpoint: " + "; ".join(diff))


def model_config_from_json(data: dict, source: str) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{source}: unknown ModelConfig fields {unknown}")
    try:
        return ModelConfig(**data)
    except TypeError as exc:
        raise ValueError(f"{source}: invalid model config ({exc})") from None
