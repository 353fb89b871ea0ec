"""Loading a checkpoint leaves none of its files open or mapped in the process.

safetensors maps the file it reads, and megatron's RNG tracker keeps the very tensors it is given: the
``rng_rank{r}.safetensors`` a resume or an evaluation restored stayed mapped until the process ended (a pruned
checkpoint's space was not freed; a read-only mount of the run could not be unmounted). The restored states are
now copies."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from support.run_fixtures import run_recipe

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


def _held(root: Path) -> list[str]:
    """Files under ``root`` this process has mapped or open."""
    prefix = str(root.resolve())
    held = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if line.split()[-1].startswith(prefix)]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            held.append(target)
    return held


def test_an_evaluated_checkpoint_is_not_left_mapped(tmp_path, capsys):
    from megatron_logra.cli import main

    run = tmp_path / "run"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=2", "train.save_interval=2", "train.progress=false"])
    gc.collect()
    assert _held(run) == []
    assert main(["eval", str(run)]) == 0
    capsys.readouterr()
    gc.collect()
    assert _held(run) == [], "files of the checkpoint still held after eval"
