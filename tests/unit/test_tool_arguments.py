"""The benchmark and tool scripts refuse bad arguments the way argparse does: exit status 2 and a
one-line error naming the option (or config field), no traceback, before any model is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (script, arguments, what the error names)
BAD = [
    ("benchmarks/optimizer_memory.py", ["--sizes", "256xfoo", "--out", "{tmp}/x"], "--sizes"),
    ("benchmarks/optimizer_memory.py", ["--render", "{tmp}/nonexistent.json"], "--render"),
    ("benchmarks/logprob_memory.py", ["--shapes", "4096"], "--shapes"),
    ("benchmarks/logprob_memory.py", ["--chunks", "abc"], "--chunks"),
    ("benchmarks/refit_memory.py", ["--sizes", "512"], "--sizes"),
    ("benchmarks/sync_bytes.py", ["--ranks", "abc"], "--ranks"),
    ("benchmarks/sync_bytes.py", ["--threads", "0"], "--threads"),
    ("benchmarks/sync_bytes.py", ["--big-dtypes", "float32,nn"], "--big-dtypes"),
    ("benchmarks/sync_bytes.py", ["--device", "bogus"], "--device"),
    ("benchmarks/sync_bytes.py", ["--device", "cpu", "--device-models", "foo"], "--device-models"),
    ("benchmarks/bf16_rounding.py", ["--steps", "0", "--run-root", "{tmp}/bf16"], "--steps"),
    ("tools/make_warm_start.py", ["--out", "{tmp}/ws", "logra.rank=abc"], "logra.rank"),
    ("benchmarks/rl_parity.py", ["--seeds", "1", "--steps", "1", "--run-root", "{tmp}/rlp", "logra.rank=abc"],
     "logra.rank"),
    ("tools/gpu_smoke.py", ["--bogus"], "--bogus"),
    ("tools/gpu_smoke.py", ["--steps", "0"], "--steps"),
    ("tools/sglang_rollout_smoke.py", ["--engine-arg", "foo"], "--engine-arg"),
    ("tools/sglang_sync_smoke.py", ["--engine-arg", "tp_size=notjson"], "--engine-arg"),
]


def _run(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, script, *(a.format(tmp=tmp_path) for a in args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("script, args, names", BAD, ids=[f"{Path(s).stem}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_argument_is_a_usage_error(script, args, names, tmp_path):
    proc = _run(script, args, tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{Path(script).name}: error:") and names in last, proc.stderr[-2000:]
    assert not any(tmp_path.iterdir()), "a refused run left output behind"


def test_gpu_smoke_help_prints_usage_without_cuda_check(tmp_path):
    proc = _run("tools/gpu_smoke.py", ["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: gpu_smoke.py") and "--hidden" in proc.stdout
    assert "nothing to do" not in proc.stderr
