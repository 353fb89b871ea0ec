"""The benchmark and tool scripts refuse bad arguments the way argparse does: exit status 2 and a
one-line error naming the option (or config field), no traceback, before any model is built.

Each script runs as ``__main__`` in this process (``runpy``, its own ``sys.argv``, the repository
as working directory): an exception that escapes it is the traceback a user would see, and no
interpreter start-up is paid per case.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.scripts import run_script

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
    ("benchmarks/bf16_rounding.py", ["--seeds", "1,1", "--run-root", "{tmp}/bf16"], "--seeds"),
    ("tools/make_warm_start.py", ["--out", "{tmp}/ws", "logra.rank=abc"], "logra.rank"),
    ("benchmarks/rl_parity.py", ["--seeds", "1", "--steps", "1", "--run-root", "{tmp}/rlp", "logra.rank=abc"],
     "logra.rank"),
    ("benchmarks/loader_overhead.py", ["--repeats", "0"], "--repeats"),
    ("benchmarks/loader_overhead.py", ["--rank", "x"], "--rank"),
    ("tools/gpu_smoke.py", ["--bogus"], "--bogus"),
    ("tools/gpu_smoke.py", ["--steps", "0"], "--steps"),
    ("tools/gpu_smoke.py", ["--rank", "24"], "--rank"),
    ("tools/sglang_rollout_smoke.py", ["--engine-arg", "foo"], "--engine-arg"),
    ("tools/sglang_sync_smoke.py", ["--engine-arg", "tp_size=notjson"], "--engine-arg"),
]


def _run(script: str, args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """``python script args...`` with ``{tmp}`` in ``args`` replaced: (exit status, stdout, stderr)."""
    return run_script(script, [a.format(tmp=tmp_path) for a in args], monkeypatch, capsys)


@pytest.mark.parametrize("script, args, names", BAD, ids=[f"{Path(s).stem}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_argument_is_a_usage_error(script, args, names, tmp_path, monkeypatch, capsys):
    code, out, err = _run(script, args, tmp_path, monkeypatch, capsys)
    assert code == 2, out[-2000:] + err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{Path(script).name}: error:") and names in last, err[-2000:]
    assert not any(tmp_path.iterdir()), "a refused run left output behind"


def test_gpu_smoke_help_prints_usage_without_cuda_check(tmp_path, monkeypatch, capsys):
    code, out, err = _run("tools/gpu_smoke.py", ["--help"], tmp_path, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert out.startswith("usage: gpu_smoke.py") and "--hidden" in out
    assert "nothing to do" not in err
