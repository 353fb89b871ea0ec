"""Files a run writes are readable as the umask allows: safetensors (0.6+) leaves its files 0600 whatever the
umask, which would lock every other user (and a serving account) out of a checkpoint's RNG states and of a
warm start on shared storage."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from megatron_logra.checkpoint.files import save_safetensors


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_save_safetensors_takes_the_umask_and_round_trips(tmp_path, umask_022):
    from safetensors.torch import load_file

    path = tmp_path / "x.safetensors"
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_safetensors(tensors, path, metadata={"k": "v"})
    assert _mode(path) == 0o644
    assert torch.equal(load_file(str(path))["a"], tensors["a"])
    os.umask(0o077)
    save_safetensors(tensors, path)
    assert _mode(path) == 0o600


def test_a_saved_checkpoint_has_no_owner_only_files(tmp_path, umask_022, one_thread):
    from megatron_logra.cli import main

    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=1", "train.save_interval=1",
                 "train.progress=false", "train.eval_interval=0", "--num-layers", "1", "--hidden-size", "32",
                 "--ffn-hidden-size", "64", "logra.rank=4"]) == 0
    files = [p for p in (run / "checkpoints").rglob("*") if p.is_file()]
    assert any(p.name.startswith("rng_rank") for p in files)
    owner_only = [str(p.relative_to(run)) for p in files if not _mode(p) & stat.S_IRGRP]
    assert not owner_only, owner_only
