"""tools/memory_stress.py on a CUDA device: allocator peaks per step, LoGRA optimizer state below dense."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_stress_on_cuda(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, str(ROOT / "tools" / "memory_stress.py"), "--device", "cuda", "--hidden", "512",
           "--layers", "2", "--vocab", "32000", "--seq-len", "512", "--micro-batch", "2", "--rank", "32",
           "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "memory_stress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["optimizer"], r["step"]) for r in rows] == [("logra", "1"), ("logra", "2"), ("adam", "1"), ("adam", "2")]
    for r in rows:
        assert r["device"] == "cuda"
        assert 0 < int(r["peak_allocated_bytes"]) <= int(r["peak_reserved_bytes"])
        assert r["live_tensor_peak_bytes"] == "" and r["peak_rss_bytes"] == ""
        if r["nvml_peak_used_bytes"]:  # present only with nvidia-ml-py and the NVML library
            assert int(r["nvml_peak_used_bytes"]) >= int(r["peak_reserved_bytes"])
    state = {r["optimizer"]: int(r["optimizer_state_bytes"]) for r in rows}
    assert state["logra"] < state["adam"], state
    assert (tmp_path / "memory_stress.png").stat().st_size > 1000
