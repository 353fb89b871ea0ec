"""``benchmarks/sync_bytes.py --baseline-rev``: a revision that git cannot show is a one-line usage error
carrying git's own message, and the scratch directory of the baseline modules is removed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_bytes_bench", ROOT / "benchmarks" / "sync_bytes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _refused(sb, rev, tmp_path, monkeypatch, capsys) -> str:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(SystemExit) as exc:
        sb.main(["--baseline-rev", rev, "--repeats", "1", "--out", str(tmp_path / "out" / "x.md")])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{Path(sys.argv[0]).name}: error: argument --baseline-rev:"), err
    assert not any(scratch.iterdir()), "the baseline's scratch directory was left behind"
    assert not (tmp_path / "out").exists()
    return last


def test_unknown_revision_is_one_line_with_gits_message(sb, tmp_path, monkeypatch, capsys):
    """Was a ``CalledProcessError`` traceback (exit 1) that dropped git's "invalid object name"."""
    last = _refused(sb, "nosuchrev", tmp_path, monkeypatch, capsys)
    assert "'nosuchrev'" in last and "megatron_logra/sketch/random_projection.py" in last
    git = subprocess.run(["git", "-C", str(ROOT), "show", "nosuchrev:megatron_logra/sketch/random_projection.py"],
                         capture_output=True, text=True)
    assert git.returncode != 0 and " ".join(git.stderr.split()) in last


def test_revision_older_than_the_files_names_the_missing_file(sb, tmp_path, monkeypatch, capsys):
    root = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                          text=True).stdout.split()
    missing = [(rev, path) for rev in root for path in sb._BASELINE_FILES.values()
               if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:{path}"],
                                 capture_output=True).returncode != 0]
    if not missing:
        pytest.skip("the first commit already has every baseline file")
    rev, path = missing[0]
    last = _refused(sb, rev, tmp_path, monkeypatch, capsys)
    assert rev in last and path in last
