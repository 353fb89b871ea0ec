"""The CLI's jobs on a GPU: model, micro-batches, rollout engine and loop statistics on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "megatron_logra.cli", "train", *args, f"train.run_dir={tmp_path}",
                           "train.progress=false"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout[proc.stdout.index("{"): proc.stdout.rindex("}") + 1])


def test_lm_job_trains_on_gpu(tmp_path):
    summary = _train(tmp_path, "lm-tiny", "train.steps=20")
    assert summary["last_loss"] < summary["first_loss"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # per-step device peaks: tensors within what the allocator reserved
        assert 0 < r["gpu_memory_peak_bytes"] <= r["gpu_memory_reserved_peak_bytes"]
        assert r["tokens_per_second"] > 0


def test_rl_job_runs_on_gpu(tmp_path):
    summary = _train(tmp_path, "tiny", "rl.steps=2", "rl.eval_interval=0")
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["kl_actual"] is not None for r in records)
    assert all(0 < r["gpu_memory_peak_bytes"] <= r["gpu_memory_reserved_peak_bytes"] for r in records)


def test_float16_rl_job_scales_its_loss_on_gpu(tmp_path):
    """``--fp16`` on CUDA: the loss scale starts at ``optimizer.loss_scale.initial``, every applied step records the
    scale it ran at (the first after its overflow re-runs, if any), and the steps train."""
    summary = _train(tmp_path, "tiny", "--fp16", "rl.steps=3", "rl.eval_interval=0",
                     f"optimizer.loss_scale.initial={2.0**17}")  # 2**17 overflows float16 at once
    assert summary["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and not any(r["skipped"] for r in records)
    first = records[0]
    assert first["overflow_retries"] >= 1 and first["loss_scale"] < 2.0**17
    assert all(r["loss_scale"] <= first["loss_scale"] for r in records[1:])


def test_elapsed_waits_for_the_kernels_queued_on_the_device():
    """A step's time includes its last kernels, which still run when the host has queued them."""
    import time

    from megatron_logra.metrics import elapsed

    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(20):
        a = a @ a.T / 64
    end.record()
    seconds = elapsed(t0, device)
    assert end.query(), "elapsed returned before the queued kernels finished"
    assert seconds >= start.elapsed_time(end) / 1e3
