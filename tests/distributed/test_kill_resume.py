"""SIGKILL at a random moment (including mid-save), then ``train --resume RUN_DIR``: bitwise the same run.

An uninterrupted 1-process LoGRA run of N steps that saves after every step is the reference.
The same run is started again and killed with SIGKILL (the process and every child, e.g.
dist_checkpointing's writer processes) at a random moment after its first checkpoint — between
steps, inside a step, or while a checkpoint is being written — twice in a row (the second time
from a resumed process). Debris of a save that died half-way (a partial ``step_*.tmp`` and a
stale ``latest.tmp``) is then added, and the run is resumed to N. Its final checkpoint (model,
optimizer, RNG states) and every step's metrics must equal the reference bitwise.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from test_resume import COMPARED, _metrics, _tensors

pytestmark = pytest.mark.distributed

N = 6
ARGS = ["train.progress=false", "train.eval_interval=0", "train.save_interval=1", "train.keep_last=2",
        "train.micro_batch_size=8", "train.global_batch_size=16", "train.log_interval=100",
        "model.hidden_dropout=0.1"]


def _latest_step(run: Path) -> int:
    marker = run / "checkpoints" / "latest"
    try:
        return int(marker.read_text().strip().split("_")[-1])
    except (FileNotFoundError, ValueError):
        return 0


def _kill_at_random(launcher, run: Path, argv: list[str], rng: random.Random, log: Path) -> str:
    """Start ``argv``, wait for a checkpoint newer than the current one, SIGKILL after a random delay."""
    before = _latest_step(run)
    proc = launcher.start(["-m", "megatron_logra.cli", *argv], log=log)
    deadline = time.monotonic() + 240
    try:
        while _latest_step(run) <= before:
            if proc.poll() is not None:
                pytest.fail(f"run exited ({proc.returncode}) before its first checkpoint:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no checkpoint within 240 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)
        finished = proc.poll() is not None
    finally:
        launcher.kill(proc.pid)
        proc.wait()
    return f"latest step {_latest_step(run)} after a {delay:.2f}s delay" + (" (had already finished)" if finished else "")


def test_sigkill_at_random_moments_then_resume(launcher, tmp_path):
    seed = int(os.environ.get("KILL_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    ref, run = tmp_path / "reference", tmp_path / "killed"
    pool = ThreadPoolExecutor(1)  # the reference is independent of the killed run: side by side
    reference = pool.submit(launcher.launch, 1, ["-m", "megatron_logra.cli", "train", "lm-tiny",
                                                 f"train.run_dir={ref}", f"train.steps={N}", *ARGS],
                            timeout=300, log=tmp_path / "reference.log")
    kills = [_kill_at_random(launcher, run, ["train", "lm-tiny", f"train.run_dir={run}", f"train.steps={N}", *ARGS],
                             rng, tmp_path / "kill1.log")]
    if _latest_step(run) < N:
        kills.append(_kill_at_random(launcher, run, ["train", "--resume", str(run)], rng, tmp_path / "kill2.log"))
    where = f"KILL_SEED={seed}: {kills}"

    # debris of a save that died half-way must be ignored (and replaced)
    ckpts = run / "checkpoints"
    last = ckpts / (ckpts / "latest").read_text().strip()
    step = _latest_step(run)
    if step < N:
        partial = ckpts / f"step_{step + 1:08d}.tmp"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(last, partial)
        (partial / "meta.json").unlink()
        shard = next((partial / "dist").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    (ckpts / "latest.tmp").write_text("step_99999999")

    proc = launcher.launch(1, ["-m", "megatron_logra.cli", "train", "--resume", str(run)], timeout=300,
                           log=tmp_path / "resume.log")
    summary = json.loads(proc.stdout[proc.stdout.index("{"): proc.stdout.rindex("}") + 1])
    assert (summary["steps"], summary["segment_steps"]) == (N, N - step), where
    reference.result()
    pool.shutdown()

    final_ref, final_run = ckpts.parent.parent / "reference" / "checkpoints", ckpts
    assert (final_run / "latest").read_text().strip() == f"step_{N:08d}", where
    a = _tensors(final_ref / f"step_{N:08d}")
    b = _tensors(final_run / f"step_{N:08d}")
    assert set(a) == set(b), where
    for key in a:
        assert torch.equal(a[key], b[key]), f"{where}: {key} differs from the uninterrupted run"
    m_ref, m_run = _metrics(ref), _metrics(run)
    assert [r["step"] for r in m_run] == list(range(1, N + 1)), f"{where}: each step once in metrics.jsonl"
    for x, y in zip(m_ref, m_run):
        for key in COMPARED:
            assert x[key] == y[key], f"{where}: step {x['step']} {key} {x[key]!r} vs {y[key]!r}"
