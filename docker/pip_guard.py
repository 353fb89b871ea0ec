"""Build-time helpers of docker/Dockerfile: keep the base image's torch / TransformerEngine / apex.

    python docker/pip_guard.py constraints OUT.txt     # pin the protected packages at their installed versions
    python docker/pip_guard.py sglang-requirements OUT.txt
        # SGLang's requirements minus the protected packages; fails unless SGLang's torch pin has the
        # base image's torch major.minor

Every later ``pip install`` runs with ``PIP_CONSTRAINT`` pointing at the constraints file, so pip
stops with a conflict instead of replacing torch, TE or apex. SGLang itself is installed with
``--no-deps`` (it pins an exact PyPI torch) and then its other requirements from the second file.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

PROTECTED = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|pytorch[-_]triton|apex|flash[-_]attn|"
    r"transformer[-_]engine(?:[-_].*)?)$", re.IGNORECASE)


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0]


def constraints(out: str) -> None:
    lines = []
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and PROTECTED.match(name):
            lines.append(f"{name}=={dist.version}")
    if not any(line.lower().startswith("torch==") for line in lines):
        sys.exit("pip_guard: torch is not installed in the base image")
    with open(out, "w") as f:
        f.write("\n".join(sorted(set(lines))) + "\n")
    print("pip_guard: protected\n  " + "\n  ".join(sorted(set(lines))))


def sglang_requirements(out: str) -> None:
    torch_version = md.version("torch")
    reqs = [r for r in (md.requires("sglang") or []) if "extra ==" not in r]
    pins = [r for r in reqs if _name(r).lower() == "torch"]
    pin = re.search(r"==\s*(\d+)\.(\d+)", pins[0]) if pins else None
    base = re.match(r"(\d+)\.(\d+)", torch_version)
    if pin and base and pin.groups() != base.groups():
        sys.exit(f"pip_guard: sglang {md.version('sglang')} requires {pins[0]} but the base image has torch "
                 f"{torch_version}; pick SGLANG_VERSION for torch {base.group(1)}.{base.group(2)} (docker/README.md)")
    keep = [r for r in reqs if not PROTECTED.match(_name(r))]
    with open(out, "w") as f:
        f.write("\n".join(keep) + "\n")
    print(f"pip_guard: sglang {md.version('sglang')} on torch {torch_version}: {len(keep)} requirements, "
          f"skipped {sorted({_name(r) for r in reqs if PROTECTED.match(_name(r))})}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("constraints", "sglang-requirements"):
        sys.exit(__doc__)
    (constraints if sys.argv[1] == "constraints" else sglang_requirements)(sys.argv[2])
