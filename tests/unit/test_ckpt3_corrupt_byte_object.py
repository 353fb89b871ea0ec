"""A byte object (a layer's ``_extra_state``) damaged at the same size is reported by its CRC-32.

The pickles of ``dist/`` are read only after every recorded size and CRC-32 matched, so a bit flip there is
named as corruption (``has CRC-32 ..., ... was written``), not as a possibly crafted pickle; the resume
pre-checks (``check_resume_steps``, ``resume_config``) read meta.json only. Where no CRC-32 can tell
(``checksums=False``), the refusal never passes on torch's advice to load with ``weights_only=False``.

Single-process gloo world; one lm-tiny run of one step through the command line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_logra.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from megatron_logra.checkpoint.run_dir import check_resume_steps, resume_config
from megatron_logra.cli import main
from support.ckpt_corruption import flip_inside_a_byte_object
from test_checkpoint_checksums import _model

_ADVICE = "Re-running `torch.load`"
"""How torch's own message for a refused ``weights_only`` load begins its advice."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _flip_inside_a_byte_object(ckpt: Path) -> tuple[str, str]:
    """A byte flipped so that torch refuses the object with its advice (``_ADVICE``)."""
    return flip_inside_a_byte_object(ckpt, refusal_contains=_ADVICE)


@pytest.fixture(scope="module")
def saved(groups, tmp_path_factory) -> dict[bool, Path]:
    """A weights-only checkpoint saved with CRC-32s (True) and without (False)."""
    model = _model(groups, seed=3)
    base = tmp_path_factory.mktemp("ckpt")
    return {flag: save_checkpoint(base / f"run_{flag}", 1, model, None, groups, checksums=flag) for flag in (True, False)}


def test_a_flipped_byte_object_byte_is_named_by_its_crc32(saved, groups, tmp_path):
    ckpt = Path(shutil.copytree(saved[True], tmp_path / "step"))
    rel, _ = _flip_inside_a_byte_object(ckpt)
    for check in (lambda: read_meta(ckpt), lambda: load_checkpoint(ckpt, _model(groups, seed=11), None, groups)):
        with pytest.raises(CheckpointError, match=rf"{rel} has CRC-32 [0-9a-f]{{8}}, [0-9a-f]{{8}} was written "
                                                  r"\(corrupt at the same size\)"):
            check()


def test_without_crc32s_the_refusal_never_passes_on_torchs_advice(saved, groups, tmp_path):
    ckpt = Path(shutil.copytree(saved[False], tmp_path / "step"))
    rel, key = _flip_inside_a_byte_object(ckpt)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, _model(groups, seed=11), None, groups, checksums=False)
    message = str(info.value)
    assert f"byte object {key!r} does not load as plain data (torch.load weights_only=True: " in message, message
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message, message
    assert "will likely succeed" not in message and _ADVICE not in message and "\n" not in message, message


def test_resume_through_the_command_line_names_the_crc32(tmp_path, capsys):
    """``--resume`` reads the run's config and checks the step count (meta.json only) before the checkpoint
    is loaded and its files are checked: the CRC-32 verdict is what the user sees."""
    run = tmp_path / "run"
    common = ["train.progress=false", "train.eval_interval=0", "train.micro_batch_size=2",
              "train.global_batch_size=2"]
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=1", *common]) == 0
    ckpt = run / "checkpoints" / "step_00000001"
    rel, _ = _flip_inside_a_byte_object(ckpt)
    check_resume_steps(run, 2, "train.steps")  # meta.json only
    assert resume_config(run)["train"]["steps"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", str(run), "train.steps=2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{rel} has CRC-32" in err and "(corrupt at the same size)" in err, err
    assert "could run code" not in err and "weights_only" not in err, err
