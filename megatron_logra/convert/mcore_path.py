"""Which checkpoint ``mcore-to-hf --mcore PATH`` exports: a checkpoint directory, or a run's latest one.

A converted directory or a trainer checkpoint step directory is taken as given; a run directory, its
``checkpoints/`` or its ``checkpoints/latest`` stand for the checkpoint ``latest`` names. Anything else is a
``ValueError`` saying what ``PATH`` is and what to pass instead, before any file is read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Union

logger = logging.getLogger(__name__)

__all__ = ["earlier_export_hint", "resolve_mcore_dir"]


def resolve_mcore_dir(path: Union[str, Path]) -> Path:
    """The checkpoint directory ``mcore-to-hf --mcore PATH`` reads.

    ``PATH`` itself when it holds ``meta.json`` (a converted directory or a trainer checkpoint step
    directory ``RUN/checkpoints/step_XXXXXXXX``). A run directory ``RUN``, its ``RUN/checkpoints`` or the
    ``RUN/checkpoints/latest`` marker stand for the checkpoint ``latest`` names (the newest complete one,
    :func:`megatron_logra.checkpoint.catalog.latest_checkpoint`). ``ValueError`` naming the problem and what
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
    from megatron_logra.checkpoint.catalog import latest_checkpoint

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


def earlier_export_hint(mcore_dir: Path) -> str:
    """For a trainer checkpoint ``RUN/checkpoints/step_XXXXXXXX`` that cannot be read: the text after ``; ``
    naming the run's newest earlier complete checkpoint and the ``--mcore`` that exports it (or that none is
    left); empty for any other directory (a ``convert hf-to-mcore`` output has no earlier one)."""
    from megatron_logra.checkpoint.catalog import _STEP_DIR, _complete_checkpoints

    step = _STEP_DIR.fullmatch(mcore_dir.name)
    if step is None or mcore_dir.parent.name != "checkpoints":
        return ""
    earlier = [p for p in _complete_checkpoints(mcore_dir.parent)
               if int(_STEP_DIR.fullmatch(p.name).group(1)) < int(step.group(1))]
    if not earlier:
        return f"; no earlier checkpoint of the run is left in {mcore_dir.parent}"
    return f"; the run's newest earlier checkpoint is {earlier[-1].name}: export it with --mcore {earlier[-1]}"
