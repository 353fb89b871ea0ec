"""Whether a checkpoint fits this run: the optimizer-state identity (optimizer, LoGRA rank, seed,
distribution, algorithm, refresh, targets, native freeze, fp32 masters) and the model architecture
recorded in ``meta.json``, each mismatch a :class:`CheckpointError` naming the config field, the
checkpoint's value, this run's, and the way on. Pure checks on ``meta.json`` contents: nothing is
read into a model here."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from megatron_logra.checkpoint.integrity import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["check_architecture", "check_compatible", "architecture_problems", "architecture_error"]


_IDENTITY = {
    "kind": "optimizer.name",
    "rank": "optimizer.logra.rank",
    "seed": "optimizer.logra.seed",
    "distribution": "optimizer.logra.distribution",
    "algorithm": "optimizer.logra.algorithm",
    "refresh": "optimizer.logra.refresh",
    "masters": "optimizer.logra.masters",
    "targets": "optimizer.logra.targets",
    "native_freeze": "optimizer.native.freeze",
}
"""Optimizer scalars that say what the saved optimizer state belongs to, and the config field each comes
from. ``masters``: ``fp32`` when the optimizer held fp32 masters; for the LoGRA targets
``model.params_dtype`` and ``optimizer.logra.masters`` decide it together, for the AdamW parameters
(``native.masters``: dense AdamW, LoGRA's non-targets) ``model.params_dtype`` alone. ``targets`` (the
target kinds, sorted) and ``native_freeze`` decide which parameters have row moments, AdamW moments or
none."""
_RECORDED_SINCE = ("masters", "algorithm", "refresh", "targets", "native_freeze")
"""Identity scalars older checkpoints do not record: compared only where recorded (missing: accepted)."""


def _saved_setting(config: Optional[Mapping], dotted: str) -> Any:
    """``config`` (meta.json's ``config``) at the dotted path, or None."""
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _identity_error(where: str, key: str, saved: Any, here: Any, config: Optional[Mapping],
                    path: str = "") -> CheckpointError:
    """The mismatch of identity scalar ``key`` (at ``path`` in the scalars, e.g. ``native`` for the AdamW
    part) as a :class:`CheckpointError` naming the config field(s) that decide it, the checkpoint's value
    and this run's, and the two ways on."""
    new_run = "or start a new run directory (train.run_dir) to train with this run's settings"
    if key == "masters" and path.split(".")[-1] == "native":
        return _native_masters_error(where, saved, here, config, new_run)
    if key == "masters":
        dtype, masters = _saved_setting(config, "model.params_dtype"), _saved_setting(config, "optimizer.logra.masters")
        recorded = ", ".join(f"{f}={v!r}" for f, v in (("model.params_dtype", dtype),
                                                       ("optimizer.logra.masters", masters)) if v is not None)
        holds = "holds fp32 master weights" if saved == "fp32" else "holds no fp32 master weights"
        return CheckpointError(
            f"{where}: the checkpoint {holds} (masters={saved!r}), this run {'has' if here == 'fp32' else 'has none'} "
            f"(masters={here!r}); model.params_dtype and optimizer.logra.masters decide it (float32 weights never have "
            f"masters; 16-bit weights have them with optimizer.logra.masters=fp32): resume with the checkpoint's "
            f"settings{f' ({recorded})' if recorded else ''}, {new_run}")
    field = _IDENTITY[key]
    if key == "targets":
        given = _saved_setting(config, field)
        resume_with = _as_override(given if isinstance(given, list) and given else saved)
        return CheckpointError(
            f"{where}: the checkpoint was saved with {field} selecting {_as_override(saved)}, this run's targets "
            f"select {_as_override(here)}; its optimizer state belongs to that target set (row moments for the "
            f"targets, AdamW moments for every other trained parameter): set {field}={resume_with} (or drop the "
            f"override) to resume it, {new_run}")
    if key == "native_freeze":  # frozen then, trained now (the reverse is accepted: check_compatible)
        return CheckpointError(
            f"{where}: the checkpoint was saved with {field}={_as_override(saved)}, this run has "
            f"{_as_override(here)}; its optimizer state holds no AdamW state for the parameters that are not LoGRA "
            f"targets: set {field}={_as_override(saved)} (or drop the override) to resume it, {new_run}")
    return CheckpointError(
        f"{where}: the checkpoint was saved with {field}={_as_override(saved)}, this run has {_as_override(here)}; "
        f"its optimizer state belongs to that setting: set {field}={_as_override(saved)} (or drop the override) to "
        f"resume it, {new_run}")


def _native_masters_error(where: str, saved: Any, here: Any, config: Optional[Mapping],
                          new_run: str) -> CheckpointError:
    """The mismatch of the AdamW parameters' fp32 masters (``native.masters``), which ``model.params_dtype``
    alone decides (``optimizer.logra.masters`` covers the LoGRA targets only)."""
    dtype = _saved_setting(config, "model.params_dtype")
    holds = "holds fp32 master weights" if saved == "fp32" else "holds no fp32 master weights"
    has = "has them" if here == "fp32" else "has none"
    resume_with = f"model.params_dtype={dtype}" if dtype is not None else "the checkpoint's model.params_dtype"
    return CheckpointError(
        f"{where}: the checkpoint's AdamW state {holds} for its parameters (native masters={saved!r}), this run "
        f"{has} (masters={here!r}); model.params_dtype decides it (16-bit weights train on fp32 masters, float32 "
        f"weights have none; optimizer.logra.masters covers the LoGRA targets only): resume with {resume_with}, "
        f"{new_run}")


def _as_override(value: Any) -> str:
    """``value`` as written in a ``field=value`` command-line override (a list as ``[a,b]``)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_as_override(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else "null" if value is None else str(value)


def check_compatible(saved: Any, current: Any, where: str, path: str = "", config: Optional[Mapping] = None) -> None:
    """The saved optimizer scalars describe the same kind of state as this run's (:data:`_IDENTITY`: same
    optimizer, LoGRA rank, seed, distribution, algorithm, projection refresh, target kinds, native freeze,
    and fp32 masters or none, of the targets and of the AdamW parameters) — checked before anything is read
    into the model, in the order the scalars list them. One change is accepted, with a warning: freezing the
    non-targets (``optimizer.native.freeze`` false, now true) only leaves their AdamW state unread.
    ``config``: meta.json's ``config``, for the message."""
    if not isinstance(current, dict):
        return
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: meta.json lacks the state {path or 'scalars'} this run needs")
    for key, here in current.items():
        name = f"{path}.{key}" if path else key
        if key in _RECORDED_SINCE and key not in saved:
            continue
        if key == "native_freeze" and here is True and saved.get(key) is False:
            logger.warning("%s was saved with optimizer.native.freeze=false, this run has true: the parameters that "
                           "are not LoGRA targets stay as the checkpoint has them, their AdamW state is not resumed "
                           "(later checkpoints of this run hold none)", where)
            continue
        if key in _IDENTITY and here is not None and saved.get(key) != here:
            raise _identity_error(where, key, saved.get(key), here, config, path)
        if isinstance(here, dict):
            if key not in saved:
                raise CheckpointError(f"{where}: meta.json lacks state '{name}'")
            check_compatible(saved[key], here, where, name, config)


def architecture_problems(meta: Mapping[str, Any], model_config: Any) -> list[str]:
    """``model.<field>`` differences between the architecture (``convert.hf_config.ARCH_FIELDS``) recorded in
    ``meta`` (``config.model``, written by the jobs) and ``model_config``; none when nothing is recorded."""
    from megatron_logra.convert.hf_config import ARCH_FIELDS

    config = meta.get("config") if isinstance(meta, Mapping) else None
    saved = config.get("model") if isinstance(config, Mapping) else None
    if not isinstance(saved, Mapping):
        return []
    return [f"model.{k}={saved[k]!r} in the checkpoint, {getattr(model_config, k)!r} in this run"
            for k in ARCH_FIELDS if k in saved and saved[k] != getattr(model_config, k)]


def architecture_error(path: Union[str, Path], problems: list[str]) -> CheckpointError:
    return CheckpointError(f"{path} holds another model: {'; '.join(problems)}; a resumed run keeps the checkpoint's "
                           "architecture: drop the override (or start a new run directory)")


def check_architecture(path: Union[str, Path], model_config: Any) -> None:
    """:class:`CheckpointError` naming every architecture field (``model.<field>``, the checkpoint's value
    and this run's) where ``model_config`` (a ``ModelConfig``) differs from the model checkpoint ``path``
    was saved with (``meta.json`` ``config.model``). Reads meta.json only (cheap, before anything is
    built); a checkpoint whose meta.json cannot be read is left to :func:`load_checkpoint` to report."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError):
        return
    problems = architecture_problems(meta, model_config)
    if problems:
        raise architecture_error(path, problems)
