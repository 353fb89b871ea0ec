"""tools/setup.sh applies tools/constraints.txt only where its pinned releases install.

The pins (numpy 2.4, matplotlib 3.11, transformers 5.25, hypothesis 6.170, ...) need Python >= 3.11, while
pyproject.toml and setup.sh accept Python >= 3.10: there pip would find no release of them and the setup
would fail. The script runs here against a stand-in interpreter that reports its version and records
the pip command it is given (nothing is installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then
  case "$2" in
    "import torch") exit 0 ;;
    *version_info*) exec "$REAL_PYTHON" -c "import sys; sys.version_info = tuple(map(int, '$FAKE_VERSION'.split('.'))); $2" ;;
    *) exit 1 ;;
  esac
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$@" >> "$PIP_LOG"
  exit 0
fi
exit 1
"""


def _setup(tmp_path: Path, version: str) -> tuple[str, str]:
    venv = tmp_path / f"venv-{version}"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    log = tmp_path / f"pip-{version}.log"
    env = {**os.environ, "VENV": str(venv), "PIP_LOG": str(log), "FAKE_VERSION": version,
           "REAL_PYTHON": shutil.which("python3") or "python3"}
    env.pop("CONSTRAINTS", None)
    proc = subprocess.run(["bash", str(ROOT / "tools" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text(), proc.stderr


@pytest.mark.parametrize("version, constrained", [("3.11", True), ("3.12", True), ("3.10", False)])
def test_constraints_apply_only_on_the_python_they_need(tmp_path, version, constrained):
    pip, stderr = _setup(tmp_path, version)
    installs = [line for line in pip.splitlines() if " install " in f" {line} " and "-e" in line.split()]
    assert len(installs) == 1, pip
    assert ("-c tools/constraints.txt" in installs[0]) is constrained, installs[0]
    if not constrained:
        assert "Python >= 3.11" in stderr
