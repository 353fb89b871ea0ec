"""What resuming a run reads from its run directory: the config to continue with, and the step to reach.

Owns :func:`resume_config` (``config.yaml`` checked against the copy of the config the latest checkpoint's
``meta.json`` holds: which of the two a resume continues with when one is cut short, damaged or edited) and
:func:`check_resume_steps` (a run's length below the step of its latest checkpoint is refused before anything
is written). Both read files only, meta.json through :mod:`megatron_logra.checkpoint.integrity`, so they run
before any process group exists. Claiming and locking the directory stay in
:mod:`megatron_logra.checkpoint.run_dir`, from which these names remain importable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Union

logger = logging.getLogger(__name__)


def check_resume_steps(run_dir: Union[str, Path], steps: int, field: str) -> None:
    """Refuse to resume ``run_dir`` when its latest checkpoint is past ``steps``, the run's length
    (``ValueError`` naming ``field``, e.g. ``train.steps`` or ``rl.steps``). Reads meta.json only
    (:func:`~megatron_logra.checkpoint.integrity.read_meta_json`; loading checks the other files), so
    a job calls it right after claiming the directory, before it writes anything: continuing would
    rewrite ``config.yaml`` and ``summary.json`` of a run whose checkpoints and metrics stay at the
    later step. Equal is fine (nothing left to train). No checkpoint: nothing to check."""
    from megatron_logra.checkpoint.integrity import read_meta_json
    from megatron_logra.checkpoint.catalog import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return
    saved = read_meta_json(ckpt)["step"]
    if steps < saved:
        raise ValueError(f"{field}={steps} is below the step of the checkpoint to resume, {ckpt} "
                         f"(step {saved}); set {field} >= {saved} to continue the run (nothing was changed)")


_SET_ON_RESUME = ("train.run_dir", "train.resume", "train.overwrite", "train.progress")
"""Fields the command line sets when it resumes a run: never compared between config.yaml and a checkpoint."""


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _read_config_yaml(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """``(config, None)`` of a readable ``config.yaml``, else ``(None, what is wrong with it)``. A key given
    twice is an edit, not damage: :class:`~megatron_logra.yaml_unique.DuplicateKeyError` is raised (which of
    the two the user meant cannot be told, and falling back to the checkpoint's copy would drop the edit)."""
    import yaml

    from megatron_logra.yaml_unique import DuplicateKeyError, safe_load_unique

    try:
        data = safe_load_unique(path.read_text())
    except DuplicateKeyError:
        raise
    except FileNotFoundError:
        return None, "it does not exist"
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        return None, f"it is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if not isinstance(data, dict) or not data:
        return None, "it is empty" if data is None else f"it holds a {type(data).__name__}, not a mapping"
    return data, None


def resume_config(run_dir: Union[str, Path]) -> dict:
    """The saved config (a :func:`megatron_logra.config.to_dict` mapping, before this resume's overrides) to
    continue the run in ``run_dir`` with: ``config.yaml``, checked against the copy of the config that the
    latest checkpoint's ``meta.json`` holds (meta.json's own CRC-32 checked; no other checkpoint file is read:
    loading it checks them).

    * ``config.yaml`` missing, empty, unparseable, not a mapping, or lacking fields the checkpoint's copy has
      (cut short, e.g. by a full disk or a kill while it was rewritten; every field the job saved is in both):
      the checkpoint's copy, with a warning naming config.yaml and what is wrong with it.
    * both complete, with other values (config.yaml is written when a run (re)starts, a checkpoint's copy when
      it saves: a resume with overrides that stopped before its first save, or an edit): config.yaml, with a
      warning naming each field and both values.
    * no checkpoint, or one that holds no config: config.yaml; ``ValueError`` naming it when it is unusable.

    ``CheckpointError`` (a ``ValueError``) for a broken ``checkpoints/latest`` or meta.json. Reads files only:
    callable before any process group exists (the command line's ``--resume RUN_DIR``)."""
    from megatron_logra.checkpoint.integrity import read_meta_json
    from megatron_logra.checkpoint.catalog import latest_checkpoint

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    from_yaml, problem = _read_config_yaml(cfg_path)
    ckpt = latest_checkpoint(run_dir)
    saved = None
    if ckpt is not None:
        saved = read_meta_json(ckpt).get("config")
        saved = saved if isinstance(saved, dict) and saved else None
    if saved is None:
        if from_yaml is None:
            raise ValueError(f"{cfg_path}: {problem}, and {run_dir} has no checkpoint holding the run's config: "
                             f"is {run_dir} a run directory?")
        return from_yaml
    if from_yaml is not None:
        have, want = _flatten(from_yaml), _flatten(saved)
        missing = [k for k in want if k not in have and k not in _SET_ON_RESUME]
        if not missing:
            differ = [k for k in want if k not in _SET_ON_RESUME and have[k] != want[k]]
            if differ:
                logger.warning("%s differs from the config saved with %s in %s: resuming with config.yaml's values "
                               "(pass the values you mean as overrides)", cfg_path, ckpt,
                               "; ".join(f"{k}: {have[k]!r} there, {want[k]!r} in the checkpoint" for k in differ[:8])
                               + (" ..." if len(differ) > 8 else ""))
            return from_yaml
        problem = (f"it lacks {len(missing)} field(s) the run saved ({', '.join(missing[:4])}"
                   f"{' ...' if len(missing) > 4 else ''}): cut short")
    logger.warning("%s is not usable (%s): resuming with the config saved with %s", cfg_path, problem, ckpt)
    return saved
