"""Build-time helpers of docker/Dockerfile: keep the base image's torch / TransformerEngine / apex.

    python docker/pip_guard.py constraints OUT.txt     # pin the protected packages at their installed versions
    python docker/pip_guard.py sglang-requirements OUT.txt NODEPS.txt WHEEL_DIR
        # SGLang's requirements minus the protected packages; fails unless SGLang's torch pin has the
        # base image's torch major.minor. Requirements that themselves pin a protected package at a version
        # the base does not have (sglang-kernel 0.4.7: torch==2.13.0 vs NGC's 2.13.0a0+<sha>) are downloaded
        # to WHEEL_DIR and their wheel paths written to NODEPS.txt (install with --no-deps); their own other
        # requirements go to OUT.txt.

Every later ``pip install`` runs with ``PIP_CONSTRAINT`` pointing at the constraints file, so pip
stops with a conflict instead of replacing torch, TE or apex. SGLang itself is installed with
``--no-deps`` (it pins an exact PyPI torch) and then its other requirements from the second file.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

PROTECTED = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|pytorch[-_]triton|apex|flash[-_]attn|"
    r"transformer[-_]engine(?:[-_].*)?)$", re.IGNORECASE)


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0]


def applicable(requirements) -> list[str]:
    """The requirements (``Requires-Dist`` strings) that apply here: markers hold, no extra asked for."""
    out = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(line.strip())
    return out


def wheel_requirements(path: str) -> list[str]:
    """The applicable ``Requires-Dist`` of a wheel; raises (ValueError, OSError, BadZipFile) if unreadable."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ValueError(f"{path}: {len(names)} dist-info/METADATA files")
        text = zf.read(names[0]).decode("utf-8")
    header = text.split("\n\n", 1)[0]
    return applicable(line.split(":", 1)[1] for line in header.splitlines()
                      if line.lower().startswith("requires-dist:"))


def protected_conflicts(requirements, installed: dict[str, str]) -> list[str]:
    """Requirements on a protected package whose specifier the installed version does not satisfy."""
    bad = []
    for line in requirements:
        req = Requirement(line)
        have = installed.get(canonicalize_name(req.name))
        if PROTECTED.match(req.name) and have is not None and not req.specifier.contains(have, prereleases=True):
            bad.append(line)
    return bad


def classify(requirements: dict[str, list[str]], installed: dict[str, str]) -> tuple[list[str], list[str]]:
    """Split ``{requirement: its distribution's requirements}`` into (requirements for ``pip install -r``,
    canonical names of packages to install with ``--no-deps``). ``installed`` maps canonical names of the
    protected packages to their installed versions. A no-deps package's other requirements (one level) are
    added to the first list; protected packages never appear in it."""
    ordinary, nodeps = [], []
    for top, deps in requirements.items():
        if PROTECTED.match(_name(top)):
            continue
        if protected_conflicts(deps, installed):
            nodeps.append(canonicalize_name(Requirement(top).name))
            ordinary += [d for d in deps if not PROTECTED.match(_name(d))]
        else:
            ordinary.append(top)
    return list(dict.fromkeys(ordinary)), nodeps


def _protected_installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()
            if d.metadata["Name"] and PROTECTED.match(d.metadata["Name"])}


def _downloaded(wheel_dir: str) -> dict[str, str]:
    files = {}
    for f in os.listdir(wheel_dir):
        try:
            name = parse_wheel_filename(f)[0] if f.endswith(".whl") else parse_sdist_filename(f)[0]
        except ValueError:
            continue
        files[canonicalize_name(name)] = os.path.abspath(os.path.join(wheel_dir, f))
    return files


def constraints(out: str) -> None:
    installed = _protected_installed()
    if "torch" not in installed:
        sys.exit("pip_guard: torch is not installed in the base image")
    lines = sorted(f"{name}=={version}" for name, version in installed.items())
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("pip_guard: protected\n  " + "\n  ".join(lines))


def sglang_requirements(out: str, nodeps_out: str, wheel_dir: str) -> None:
    torch_version = md.version("torch")
    reqs = applicable(md.requires("sglang") or [])
    pins = [r for r in reqs if _name(r).lower() == "torch"]
    pin = re.search(r"==\s*(\d+)\.(\d+)", pins[0]) if pins else None
    base = re.match(r"(\d+)\.(\d+)", torch_version)
    if pin and base and pin.groups() != base.groups():
        sys.exit(f"pip_guard: sglang {md.version('sglang')} requires {pins[0]} but the base image has torch "
                 f"{torch_version}; pick SGLANG_VERSION for torch {base.group(1)}.{base.group(2)} (docker/README.md)")
    keep = [r for r in reqs if not PROTECTED.match(_name(r))]
    os.makedirs(wheel_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as tmp:
        tmp.write("\n".join(keep) + "\n")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", wheel_dir, "-r", tmp.name],
                       check=True)
    finally:
        os.unlink(tmp.name)
    files, installed, deps = _downloaded(wheel_dir), _protected_installed(), {}
    for r in keep:
        path = files.get(canonicalize_name(Requirement(r).name))
        try:
            deps[r] = wheel_requirements(path) if path and path.endswith(".whl") else []
        except (ValueError, OSError, KeyError, UnicodeDecodeError, zipfile.BadZipFile):
            deps[r] = []  # sdist / unreadable: an ordinary requirement
    ordinary, nodeps = classify(deps, installed)
    with open(out, "w") as f:
        f.write("\n".join(ordinary) + "\n")
    with open(nodeps_out, "w") as f:
        f.write("".join(files[n] + "\n" for n in nodeps))
    print(f"pip_guard: sglang {md.version('sglang')} on torch {torch_version}: {len(ordinary)} requirements, "
          f"skipped {sorted({_name(r) for r in reqs if PROTECTED.match(_name(r))})}")
    for r, d in deps.items():
        if canonicalize_name(Requirement(r).name) in nodeps:
            why = ", ".join(f"{c} (base: {installed[canonicalize_name(Requirement(c).name)]})"
                            for c in protected_conflicts(d, installed))
            print(f"pip_guard: {_name(r)} goes in with --no-deps, the base image does not satisfy {why}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["constraints"] and len(sys.argv) == 3:
        constraints(sys.argv[2])
    elif sys.argv[1:2] == ["sglang-requirements"] and len(sys.argv) == 5:
        sglang_requirements(*sys.argv[2:])
    else:
        sys.exit(__doc__)
