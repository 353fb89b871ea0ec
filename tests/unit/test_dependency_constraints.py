"""tools/constraints.txt (the tested versions tools/setup.sh installs with) pins every dependency of the CPU
environment that pyproject.toml names, at a version pyproject.toml allows."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, which pyproject.toml allows
    tomllib = None
ROOT = Path(__file__).resolve().parents[2]
CPU_EXTRAS = ("dev", "bench")  # tools/setup.sh's default EXTRAS; gpu and sglang come with their own images


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "tools" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"{line}: a constraint pins one version (==)"
            assert canonicalize_name(req.name) not in pins, f"{req.name} is pinned twice"
            pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def _requirements() -> list[Requirement]:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs tomllib (Python >= 3.11)")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in CPU_EXTRAS:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def test_every_cpu_dependency_is_pinned_at_an_allowed_version():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned by TORCH_SPEC in tools/setup.sh
            continue
        assert name in pins, f"{req.name} (pyproject.toml) has no pin in tools/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"tools/constraints.txt pins {req.name}=={pins[name]}, which pyproject.toml's {req} excludes"


def test_setup_installs_with_the_constraints():
    setup = (ROOT / "tools" / "setup.sh").read_text()
    assert 'CONSTRAINTS="${CONSTRAINTS-tools/constraints.txt}"' in setup
    assert '${CONSTRAINTS:+-c "$CONSTRAINTS"}' in setup
