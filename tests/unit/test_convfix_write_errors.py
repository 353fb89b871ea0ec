"""A conversion whose output cannot be written (a full disk) ends with one line naming --out, the OS error and
the file, exit status 2, and leaves --out as it was (no output, no build directory; with --force the previous
conversion untouched). The disk is really full: the converter runs in a child process whose file-size limit
(RLIMIT_FSIZE, with SIGXFSZ ignored) makes ``write`` fail with EFBIG, as ENOSPC does on a full disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from support.convert_fixtures import snapshot, tiny_llama_checkpoint

LIMIT = 16 * 1024  # bytes: the configs and meta.json fit, no weight file does

CHILD = f"""
import resource, signal, sys
from megatron_logra.convert.cli import main
import megatron_logra.convert.convert  # imported before the limit is set
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tiny_llama_checkpoint(tmp_path_factory.mktemp("src"))
    assert (out / "model.safetensors").stat().st_size > 4 * LIMIT
    return out


def _run_with_full_disk(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LOGRA_TRACEBACK"}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, timeout=300)


def _check_one_line(proc: subprocess.CompletedProcess, out: Path, direction: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr
    line = errors[0]
    assert line.startswith(f"megatron-logra convert {direction}: error: writing --out {out.resolve()} failed: "), line
    assert "[Errno 27] File too large" in line and ".safetensors)" in line, line
    assert not (out.parent / f".{out.name}.partial").exists()


def test_hf_to_mcore_on_a_full_disk(hf_dir, tmp_path):
    out = tmp_path / "mc"
    proc = _run_with_full_disk(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(out), "--tp", "2"])
    _check_one_line(proc, out, "hf-to-mcore")
    assert not out.exists()


def test_mcore_to_hf_with_force_on_a_full_disk_keeps_the_previous_output(hf_dir, tmp_path):
    mc = tmp_path / "mc"
    convert_hf_to_mcore(hf_dir, mc)
    out = tmp_path / "hf_out"
    convert_mcore_to_hf(mc, out)  # a previous conversion in --out
    before = snapshot(out)
    proc = _run_with_full_disk(["mcore-to-hf", "--mcore", str(mc), "--out", str(out), "--force"])
    _check_one_line(proc, out, "mcore-to-hf")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_out", "mc"]
