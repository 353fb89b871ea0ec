"""``mcore-to-hf --no-verify`` skips the checksum pass over a trainer checkpoint, as its help says.

A trainer checkpoint (``RUN/checkpoints/step_XXXXXXXX``) records a size and CRC-32 per file. The
export always checked every file's CRC-32 (optimizer state included: a full read of a 27B checkpoint)
whatever ``--no-verify`` said. Here a byte of ``rng_rank0.safetensors`` (recorded, never read by the
export) is flipped: the default export refuses the checkpoint naming the file; ``--no-verify``
exports it. A truncated file is refused either way (sizes are always checked).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import pytest

from megatron_logra.checkpoint import save_checkpoint
from megatron_logra.convert.cli import build_parser
from megatron_logra.convert.cli import main as convert_main
from megatron_logra.models.gpt import build_gpt
from test_checkpoint_checksums import MODEL


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def step(groups, tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(MODEL, groups, seed=1)
    root = tmp_path_factory.mktemp("run")
    return save_checkpoint(root / "run", 1, model, None, groups, config={"model": dataclasses.asdict(MODEL)})


def _damaged(step, tmp_path, *, truncate: bool):
    run = tmp_path / "run"
    shutil.copytree(step.parent.parent, run)
    copy = run / "checkpoints" / step.name
    rng = copy / "rng_rank0.safetensors"
    assert "rng_rank0.safetensors" in json.loads((copy / "meta.json").read_text())["files"]
    data = bytearray(rng.read_bytes())
    if truncate:
        del data[-1]
    else:
        data[len(data) // 2] ^= 0xFF
    rng.write_bytes(bytes(data))
    return copy


def test_no_verify_skips_the_crc_pass_of_a_trainer_checkpoint(step, tmp_path, capsys):
    ckpt = _damaged(step, tmp_path, truncate=False)
    assert convert_main(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "checked")]) == 2
    err = capsys.readouterr().err
    assert "rng_rank0.safetensors" in err and not (tmp_path / "checked").exists()
    assert convert_main(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "fast"), "--no-verify"]) == 0
    assert (tmp_path / "fast" / "model.safetensors").is_file() and (tmp_path / "fast" / "config.json").is_file()


def test_no_verify_still_checks_file_sizes(step, tmp_path, capsys):
    ckpt = _damaged(step, tmp_path, truncate=True)
    assert convert_main(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(tmp_path / "out"), "--no-verify"]) == 2
    assert "rng_rank0.safetensors" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_help_says_what_no_verify_skips():
    sub = build_parser()._subparsers._group_actions[0].choices["mcore-to-hf"]
    text = " ".join(sub.format_help().split())
    assert "CRC-32 of every file of a trainer checkpoint" in text and "sha256" in text
