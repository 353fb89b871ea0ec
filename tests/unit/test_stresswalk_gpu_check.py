"""tools/gpu_check.sh run with an interpreter that cannot import torch (the default ``python3`` of a machine whose
project environment is a venv): the summary says so and that nothing was checked, exit status 1, instead of
reporting "NO CUDA DEVICE" (nothing looked for one) and that test collection worked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_without_torch_is_named_not_taken_for_no_cuda(tmp_path):
    no_torch = tmp_path / "python-no-site"  # the same interpreter without site-packages: no torch, no pytest
    no_torch.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    no_torch.chmod(0o755)
    assert subprocess.run([str(no_torch), "-c", "import torch"], capture_output=True).returncode != 0
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=str(no_torch), TEST_TIMEOUT="60")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out), str(tmp_path / "no-wheels")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ModuleNotFoundError" in (out / "env.txt").read_text()  # env.txt holds the reason
    summary = (out / "summary.txt").read_text()
    first = summary.splitlines()[0]
    assert first.startswith("NOT CHECKED: ") and "cannot import torch" in first and str(no_torch) in first, summary
    assert "NO CUDA DEVICE" not in summary and "test collection worked" not in summary, summary
    assert "cannot import torch" in (out / "smoke.txt").read_text()
