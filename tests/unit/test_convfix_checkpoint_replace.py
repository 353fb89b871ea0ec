"""Saving a step that already has a checkpoint never leaves ``latest`` naming a missing directory: the old
``step_XXXXXXXX`` is renamed aside (``step_XXXXXXXX.old-PID``), the new one renamed in, ``latest`` written, and
only then the old one deleted. A failure (or a kill) at any of those points leaves a checkpoint that loads
through ``latest``; the aside directory is never listed, pruned or counted as a checkpoint, and the next save
restores or deletes it. Failures are injected into the real ``os.replace`` / ``shutil.rmtree`` of one call;
everything else runs on real files.

Single-process gloo world, tiny weights-only checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_logra.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_logra.checkpoint.catalog import _complete_checkpoints
from test_checkpoint_checksums import _model, _weights


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def models(groups):
    """Two models with different weights: the checkpoint of step 5 is saved from the first, then replaced."""
    return _model(groups, seed=3), _model(groups, seed=4)


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _loads_as(run: Path, weights: dict, groups) -> Path:
    """``latest`` resolves to a checkpoint whose weights load and equal ``weights``; returns it."""
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    fresh = _model(groups, seed=11)
    load_checkpoint(ckpt, fresh, None, groups)
    got = _weights(fresh)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    return ckpt


def _fail_once(monkeypatch, module, name, when):
    """Make ``module.name`` raise ``OSError`` on its first call for which ``when(*args)`` holds."""
    real = getattr(module, name)
    fired = []

    def patched(*args, **kwargs):
        if not fired and when(*args):
            fired.append(args)
            raise OSError(5, "Input/output error (injected)", str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, patched)
    return fired


def test_a_failed_rename_in_keeps_the_previous_checkpoint(models, groups, tmp_path, monkeypatch):
    first, second = models
    run = tmp_path / "run"
    save_checkpoint(run, 5, first, None, groups)
    fired = _fail_once(monkeypatch, os, "replace", lambda src, dst, *a: Path(src).name == "step_00000005.tmp")
    with pytest.raises(CheckpointError):
        save_checkpoint(run, 5, second, None, groups)
    monkeypatch.undo()
    assert fired
    assert _loads_as(run, _weights(first), groups).name == "step_00000005"
    assert _names(run) == ["latest", "step_00000005"]  # renamed back; the unfinished save removed


def test_a_kill_between_the_renames_loads_the_aside_copy_and_the_next_save_restores_it(models, groups, tmp_path,
                                                                                        monkeypatch):
    """The rename in fails and so does renaming the old copy back: what a kill between the two renames
    leaves (``latest`` names step 5, only ``step_00000005.old-PID`` holds it)."""
    first, second = models
    run = tmp_path / "run"
    save_checkpoint(run, 5, first, None, groups)
    real = os.replace

    def failing(src, dst, *args, **kwargs):
        if Path(dst).name == "step_00000005":
            raise OSError(5, "Input/output error (injected)", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointError):
        save_checkpoint(run, 5, second, None, groups)
    monkeypatch.undo()
    assert (run / "checkpoints" / "latest").read_text() == "step_00000005"
    aside = [n for n in _names(run) if n.startswith("step_00000005.old-")]
    assert len(aside) == 1 and not (run / "checkpoints" / "step_00000005").exists()
    assert _loads_as(run, _weights(first), groups).name == aside[0]
    assert _complete_checkpoints(run / "checkpoints") == []  # never listed as a checkpoint

    save_checkpoint(run, 6, second, None, groups, keep_last=2)  # restores step 5 first; both kept
    assert _names(run) == ["latest", "step_00000005", "step_00000006"]
    assert _loads_as(run, _weights(second), groups).name == "step_00000006"
    fresh = _model(groups, seed=11)
    load_checkpoint(run / "checkpoints" / "step_00000005", fresh, None, groups)
    assert all(torch.equal(v, _weights(first)[k]) for k, v in _weights(fresh).items())


def test_a_failed_delete_of_the_old_copy_leaves_the_new_checkpoint(models, groups, tmp_path, monkeypatch):
    first, second = models
    run = tmp_path / "run"
    save_checkpoint(run, 4, first, None, groups)
    save_checkpoint(run, 5, first, None, groups)
    fired = _fail_once(monkeypatch, shutil, "rmtree", lambda path, *a: ".old-" in Path(path).name)
    save_checkpoint(run, 5, second, None, groups, keep_last=2)
    monkeypatch.undo()
    assert fired
    aside = [n for n in _names(run) if ".old-" in n]
    assert len(aside) == 1
    assert _loads_as(run, _weights(second), groups).name == "step_00000005"
    assert [p.name for p in _complete_checkpoints(run / "checkpoints")] == ["step_00000004", "step_00000005"]

    save_checkpoint(run, 6, second, None, groups, keep_last=2)  # the leftover is deleted, never counted
    assert _names(run) == ["latest", "step_00000005", "step_00000006"]
    assert _loads_as(run, _weights(second), groups).name == "step_00000006"
