"""Tools given an output directory that cannot be written refuse it at once with one ``error:`` line (exit
status 2) instead of a traceback after the work, or -- for the fuzzer's ``--dump`` -- instead of losing the
failing messages' bytes when the first failure is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import forked

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, args, flag", [
    ("tools/memory_stress.py", ["--dry-run", "--model", "qwen2.5-1.5b", "--out", "{below}"], "--out"),
    ("tools/make_warm_start.py", ["--steps", "1", "--out", "{below}"], "--out"),
    ("tools/fuzz_sync_codec.py", ["--messages", "1", "--dump", "{below}"], "--dump"),
])
def test_an_output_directory_below_a_file_is_refused_before_the_work(tmp_path, script, args, flag):
    plain = tmp_path / "plain"
    plain.write_text("a file, not a directory")
    argv = [a.replace("{below}", str(plain / "sub")) for a in args]
    proc = forked.python([str(ROOT / script), *argv], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error:" in last and flag in last and f"{plain} is not a directory" in last
    assert plain.read_text() == "a file, not a directory" and not (tmp_path / "runs").exists()
