"""docker/pip_guard.py: which of SGLang's requirements must go in with --no-deps (no network, no docker)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pip_guard", ROOT / "docker" / "pip_guard.py")
pip_guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_guard)

NGC_TORCH = {"torch": "2.13.0a0+abc123"}
PYPI_TORCH = {"torch": "2.13.0"}


def fake_wheel(tmp_path: Path, name: str, requires: list[str]) -> str:
    path = tmp_path / f"{name}-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: 1.0\n{}\nDescription body\nRequires-Dist: bogus\n".format(
        name, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-1.0.dist-info/METADATA", meta)
        zf.writestr(f"{name}/__init__.py", "")
    return str(path)


def test_wheel_requirements_markers_and_extras(tmp_path):
    path = fake_wheel(tmp_path, "sglang_kernel", [
        "torch==2.13.0",
        "numpy>=1.0",
        'pywin32>=300; sys_platform == "nonexistent-os"',
        'pytest; extra == "test"',
        'requests; python_version >= "3.0"',
    ])
    assert pip_guard.wheel_requirements(path) == ["torch==2.13.0", "numpy>=1.0",
                                                  'requests; python_version >= "3.0"']


def test_wheel_requirements_rejects_non_wheel(tmp_path):
    sdist = tmp_path / "foo-1.0.tar.gz"
    sdist.write_bytes(b"not a zip")
    with pytest.raises(zipfile.BadZipFile):
        pip_guard.wheel_requirements(str(sdist))


def test_exact_pypi_pin_goes_nodeps_on_ngc_torch(tmp_path):
    reqs = {
        "sglang-kernel==0.4.7": pip_guard.wheel_requirements(
            fake_wheel(tmp_path, "sglang_kernel", ["torch==2.13.0", "numpy>=1.0", 'pytest; extra == "test"'])),
        "flashinfer-python>=0.3": ["torch>=2.10", "ninja"],
        "requests": [],
    }
    ordinary, nodeps = pip_guard.classify(reqs, NGC_TORCH)
    assert nodeps == ["sglang-kernel"]
    assert ordinary == ["numpy>=1.0", "flashinfer-python>=0.3", "requests"]


def test_exact_pin_is_ordinary_when_base_matches():
    ordinary, nodeps = pip_guard.classify({"sglang-kernel==0.4.7": ["torch==2.13.0", "numpy>=1.0"]}, PYPI_TORCH)
    assert nodeps == []
    assert ordinary == ["sglang-kernel==0.4.7"]


def test_range_pin_stays_ordinary_on_prerelease_torch():
    ordinary, nodeps = pip_guard.classify({"flashinfer-python": ["torch>=2.10"]}, NGC_TORCH)
    assert (ordinary, nodeps) == (["flashinfer-python"], [])


def test_protected_never_ordinary():
    reqs = {
        "torch==2.13.0": [],
        "triton>=3": [],
        "transformer_engine[pytorch]": [],
        "sgl-deep-ep==0.1.2": ["torch==2.13.0", "torchvision==0.28.0", "triton", "pyyaml"],
        "xgrammar": ["torch>=2.0", "tiktoken"],
    }
    ordinary, nodeps = pip_guard.classify(reqs, {**NGC_TORCH, "triton": "3.6.0"})
    assert nodeps == ["sgl-deep-ep"]
    assert ordinary == ["pyyaml", "xgrammar"]


def test_uninstalled_protected_package_is_no_conflict():
    ordinary, nodeps = pip_guard.classify({"foo": ["torchaudio==2.13.0"]}, NGC_TORCH)
    assert (ordinary, nodeps) == (["foo"], [])


def test_no_args_prints_usage():
    proc = subprocess.run([sys.executable, str(ROOT / "docker" / "pip_guard.py")], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "sglang-requirements OUT.txt NODEPS.txt WHEEL_DIR" in proc.stderr
