"""The checkpoints of a run: which one ``latest`` names, which are complete, which to prune.

``RUN/checkpoints/`` holds ``step_XXXXXXXX`` directories (published only once complete), unfinished
``step_XXXXXXXX.tmp`` saves and ``latest``, the name of the newest complete checkpoint. A save of a step that
already has a checkpoint renames the old one aside to ``step_XXXXXXXX.old-PID`` until the new one is in place
(:func:`aside_name`); such a directory is never listed, counted or pruned as a checkpoint, is read only when
``latest`` names its step and the step's directory is missing (a kill between the two renames), and the next
save restores or deletes it (:func:`settle_asides`). A ``latest`` that is missing is recovered from the newest
complete checkpoint; one that names anything else is refused with the newest earlier checkpoint to continue
from (:func:`earlier_checkpoint_hint`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional, Union

from megatron_logra.checkpoint.durable import fsync_path
from megatron_logra.checkpoint.integrity import CheckpointError, read_meta_json
from megatron_logra.parallel import group_rank, world_group

logger = logging.getLogger(__name__)

__all__ = ["latest_checkpoint", "checkpoint_at_step", "earlier_checkpoint_hint"]

_STEP_DIR = re.compile(r"step_(\d{8,})")
_ASIDE_DIR = re.compile(r"(step_\d{8,})\.old-\d+")
"""A replaced checkpoint while its replacement is renamed in: ``step_XXXXXXXX.old-PID`` (never a checkpoint name)."""


def aside_name(final: Path) -> Path:
    """Where a save renames the existing checkpoint ``final`` (``step_XXXXXXXX``) while it renames the new one
    in: the sibling ``step_XXXXXXXX.old-PID``."""
    return final.with_name(f"{final.name}.old-{os.getpid()}")


def _asides_of(root: Path, name: Optional[str] = None) -> list[Path]:
    """The aside directories of ``root`` (of checkpoint ``name`` only, when given), sorted by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and (m := _ASIDE_DIR.fullmatch(p.name)) and (name is None or m.group(1) == name))


def _readable_aside(root: Path, name: str) -> Optional[Path]:
    """An aside directory of checkpoint ``name`` whose meta.json reads and checks, or None."""
    for aside in _asides_of(root, name):
        try:
            read_meta_json(aside)
        except (CheckpointError, OSError):
            continue
        return aside
    return None


def settle_asides(root: Path) -> None:
    """Finish replacements of a checkpoint that a kill interrupted (rank 0, before a save): an aside
    ``step_XXXXXXXX.old-PID`` whose ``step_XXXXXXXX`` exists was superseded and is deleted; one whose
    ``step_XXXXXXXX`` is missing (killed between the renames) is the only copy of that published checkpoint and
    is renamed back (when its meta.json checks; otherwise deleted)."""
    for aside in _asides_of(root):
        final = root / _ASIDE_DIR.fullmatch(aside.name).group(1)
        if not final.exists() and not final.is_symlink() and _readable_aside(root, final.name) == aside:
            os.replace(aside, final)
            fsync_path(root, directory=True)
            logger.warning("restored checkpoint %s from %s: a save replacing it was interrupted", final, aside.name)
        else:
            shutil.rmtree(aside)


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest checkpoints up to ``step`` (the one just saved, which
    ``latest`` names). Checkpoints of later steps are someone's earlier timeline (``latest`` was
    rolled back): kept, and replaced when training reaches their step."""
    saved = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))
    for _, old in [(s, p) for s, p in saved if s <= step][:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    later = [p.name for s, p in saved if s > step]
    if later:
        logger.warning("%s holds checkpoints of later steps than %d (%s): kept, not pruned; they are replaced "
                       "when training reaches their step", root, step, ", ".join(later[:4]))


def _complete_checkpoints(root: Path) -> list[Path]:
    """The checkpoint directories ``step_XXXXXXXX`` of ``root`` whose meta.json reads and checks by itself
    (:func:`~megatron_logra.checkpoint.integrity.read_meta_json`), oldest first. A save is renamed to its
    final name only once complete, so these are the published ones (their shards are checked at load)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m is None or not (p / "meta.json").is_file():
            continue
        try:
            read_meta_json(p)
        except (CheckpointError, OSError):
            continue
        found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def checkpoint_at_step(run_dir: Union[str, Path], step: int) -> Path:
    """The complete checkpoint of ``run_dir`` saved at ``step`` (``checkpoints/step_XXXXXXXX``); ``ValueError``
    naming the steps that have one when it has none there (pruned by ``train.keep_last``, never saved, or
    unfinished)."""
    root = Path(run_dir) / "checkpoints"
    complete = _complete_checkpoints(root)
    for path in complete:
        if int(_STEP_DIR.fullmatch(path.name).group(1)) == step:
            return path
    steps = [int(_STEP_DIR.fullmatch(p.name).group(1)) for p in complete]
    have = f"its checkpoints are at steps {', '.join(map(str, steps))}" if steps else "it has no complete checkpoint"
    raise ValueError(f"{root} has no complete checkpoint of step {step}: {have} (train.keep_last keeps the newest "
                     f"few, every train.save_interval steps)")


def earlier_checkpoint_hint(root: Path, broken: Optional[Path] = None) -> str:
    """What to do about a broken checkpoint in ``root`` (a run's ``checkpoints/``): the text after ``; ``
    naming the newest other checkpoint there (older than ``broken``, when given) and how to resume from it
    (write its name into ``root/latest``), or, when none is left, how to start over."""
    before = _STEP_DIR.fullmatch(broken.name) if broken is not None else None
    others = [p for p in _complete_checkpoints(root)
              if before is None or int(_STEP_DIR.fullmatch(p.name).group(1)) < int(before.group(1))]
    if others:
        return (f"the newest {'earlier ' if before is not None else ''}checkpoint there is {others[-1].name}: to "
                f"continue from it, write its name into {root / 'latest'} (echo {others[-1].name} > {root / 'latest'})")
    return (f"no earlier checkpoint is left in {root}: restore its files, or start the run over "
            f"(train.overwrite=true, or another train.run_dir)")


_warned_missing_latest: set[str] = set()


def latest_checkpoint(run_dir: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None if it has none. Reads ``checkpoints/latest`` (and
    checks only that the checkpoint it names has a meta.json: loading checks the rest).

    * ``latest`` absent: None when ``checkpoints/`` holds no complete checkpoint; otherwise (a job killed
      between publishing its first checkpoint and writing ``latest``, or ``latest`` deleted) the newest
      complete one, with a warning (once per process), so that a resumed run never starts over on top of
      it (and then replaces it when it reaches its step).
    * ``latest`` that is empty, unreadable, or holds anything but the name of a checkpoint directory beside
      it (``step_XXXXXXXX``: a path elsewhere would resume another run's checkpoint), or names one that is
      missing or has no meta.json: :class:`CheckpointError` naming ``latest``, what it holds, and the
      newest earlier checkpoint to continue from (:func:`earlier_checkpoint_hint`).
    * ``latest`` naming a missing ``step_XXXXXXXX`` whose aside copy ``step_XXXXXXXX.old-PID`` is there (a save
      replacing that step killed between its two renames): that copy, with a warning."""
    root = Path(run_dir) / "checkpoints"
    marker = root / "latest"
    if not marker.exists() and not marker.is_symlink():
        complete = _complete_checkpoints(root)
        if not complete:
            return None
        if str(complete[-1]) not in _warned_missing_latest:
            _warned_missing_latest.add(str(complete[-1]))
            if group_rank(world_group()) == 0:
                logger.warning("%s is missing, but %s holds complete checkpoints (%s): using the newest, %s (a job "
                               "killed right after publishing a checkpoint leaves this; write that name into %s if "
                               "you meant to continue from another)", marker, root,
                               ", ".join(p.name for p in complete[-4:]), complete[-1].name, marker)
        return complete[-1]
    try:
        name = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{marker} is unreadable ({type(exc).__name__}: {exc}); "
                              f"{earlier_checkpoint_hint(root)}") from exc
    if not _STEP_DIR.fullmatch(name):
        held = "nothing (it is empty)" if not name else repr(name[:80])
        raise CheckpointError(f"{marker} holds {held}, not the name of a checkpoint directory beside it "
                              f"(step_XXXXXXXX); {earlier_checkpoint_hint(root)}")
    path = root / name
    if not path.exists() and not path.is_symlink():
        aside = _readable_aside(root, name)
        if aside is not None:  # a save replacing it was killed between its renames: the previous copy
            if group_rank(world_group()) == 0:
                logger.warning("%s names %s, which is missing, but %s holds it (a save replacing it was "
                               "interrupted): using it; the next save restores it", marker, name, aside.name)
            return aside
    if not (path / "meta.json").exists():
        what = "has no meta.json (incomplete or damaged)" if path.is_dir() else "does not exist (deleted?)"
        raise CheckpointError(f"{marker} names {name}, which {what}; {earlier_checkpoint_hint(root, path)}")
    return path
