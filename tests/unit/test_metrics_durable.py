"""Once a checkpoint is on storage, so are the metrics records of every step up to it.

Records are appended to ``metrics.jsonl`` without a sync between saves; each job syncs the file before it writes a
checkpoint, so a power loss or node crash after a save leaves no gap of steps before the step a resume continues
from. Storage loss cannot be simulated here, so the test watches the real ``os.fsync`` calls of a run and checks
their order: ``metrics.jsonl`` holding step k's record is synced before ``checkpoints/latest`` names step k.
A resume's rewrite of the file (dropping the records after its checkpoint) is synced too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_logra.metrics import MetricsWriter
from support.run_fixtures import run_recipe


@pytest.fixture
def synced(monkeypatch):
    """The (file name, its text) of every file ``os.fsync`` flushes, in order (directories are left out)."""
    seen: list[tuple[str, str]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.is_file():
            seen.append((path.name, path.read_text(errors="replace") if path.stat().st_size < 1 << 20 else ""))

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fd's file")
@pytest.mark.parametrize("recipe,steps", [("lm-tiny", "train.steps=5"), ("tiny", "rl.steps=5")])
def test_each_checkpoint_follows_a_sync_of_the_metrics_up_to_it(tmp_path, synced, recipe, steps):
    run = tmp_path / "run"
    short = ["task.num_eval=8", "rl.prompts_per_step=4", "rl.group_size=2"] if recipe == "tiny" else []
    run_recipe(recipe, [f"train.run_dir={run}", steps, "train.save_interval=2", "train.progress=false",
                        "train.keep_last=5", *short])
    steps_synced = 0  # the last step whose record metrics.jsonl held when it was last synced
    pointed = []
    for name, text in synced:
        if name == "metrics.jsonl":
            steps_synced = max((json.loads(line)["step"] for line in text.splitlines()), default=0)
        elif name == "latest.tmp":
            step = int(text.strip().removeprefix("step_"))
            assert steps_synced >= step, f"checkpoint {step} written with metrics synced up to step {steps_synced}"
            pointed.append(step)
    assert pointed == [2, 4, 5]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fd's file")
def test_a_resume_rewrite_of_the_metrics_is_synced(tmp_path, synced):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 5):
        w.write({"step": step, "loss": 1.0})
    w.close()
    synced.clear()
    MetricsWriter(tmp_path, tensorboard=False, truncate_after=2).close()
    written = [text for name, text in synced if name == "metrics.jsonl.tmp"]
    assert [[json.loads(line)["step"] for line in text.splitlines()] for text in written] == [[1, 2]]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
