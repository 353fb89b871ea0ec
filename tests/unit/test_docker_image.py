"""The GPU image holds what its checks run: every repository path ``tools/gpu_check.sh`` uses is copied by
``docker/Dockerfile`` to the same place under the work directory and let through by
``docker/Dockerfile.dockerignore`` (the build context sends only what that file allows). No docker here:
both files are read as text."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _copies() -> dict[str, str]:
    """``COPY`` sources (relative to the build context) -> where they land relative to the image's last
    WORKDIR, the repository root there (sources copied outside it are left out)."""
    workdir, landed = "/", {}
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if not words or words[0] not in ("WORKDIR", "COPY"):
            continue
        if words[0] == "WORKDIR":
            workdir = words[1]
        elif not any(w.startswith("--") for w in words[1:]):
            *sources, dest = words[1:]
            target = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
            for src in sources:
                land = f"{target.rstrip('/')}/{Path(src).name}" if dest.endswith("/") else target
                landed[src.strip("/")] = re.sub(r"/(\./)+", "/", land)
    root = workdir.rstrip("/") + "/"
    return {src: land[len(root):] for src, land in landed.items() if land.startswith(root)}


def _dockerignore_allows(path: str) -> bool:
    """Docker's rules for the build context: the last pattern that matches wins, ``!`` re-includes."""
    allowed = True
    for raw in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        include = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        rx = re.escape(pattern).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rx = rx.replace("\0/", "(.*/)?").replace("\0", ".*")
        if re.fullmatch(rx, path) or any(re.fullmatch(rx, p) for p in _parents(path)):
            allowed = include
    return allowed


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _gpu_check_paths() -> set[str]:
    """Relative paths in gpu_check.sh naming a script or a test directory of this repository."""
    text = (ROOT / "tools" / "gpu_check.sh").read_text()
    found = set()
    for token in re.findall(r"(?<![\w$/.{-])([A-Za-z_][\w.-]*(?:/[\w.-]+)+)", text):
        path = ROOT / token
        if path.is_file() or (path.is_dir() and any(path.glob("*.py"))):
            found.add(token)
    return found


def test_gpu_check_finds_its_paths():
    assert {"tests/gpu", "tools/gpu_smoke.py", "benchmarks/sync_bytes.py"} <= _gpu_check_paths()


def test_the_image_holds_every_path_gpu_check_uses():
    copies = _copies()
    problems = []
    for used in sorted(_gpu_check_paths()):
        source = next((s for s in copies if used == s or used.startswith(s + "/")), None)
        if source is None or copies[source] != source:
            problems.append(f"{used}: not copied to ./{used} by docker/Dockerfile (COPY {used.split('/')[0]} "
                            f"./{used.split('/')[0]})")
            continue
        files = [used] if (ROOT / used).is_file() else \
            [str(p.relative_to(ROOT)) for p in (ROOT / used).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        blocked = [f for f in files if not _dockerignore_allows(f)]
        if blocked:
            problems.append(f"{used}: docker/Dockerfile.dockerignore leaves {blocked[:3]} out of the build context")
    assert not problems, "\n".join(problems)


def test_dockerignore_rules_as_docker_reads_them():
    assert _dockerignore_allows("tools/gpu_check.sh") and _dockerignore_allows("megatron_logra/rl/job.py")
    assert not _dockerignore_allows(".venv/bin/python") and not _dockerignore_allows("runs/x/summary.txt")
    assert not _dockerignore_allows("megatron_logra/__pycache__/config.cpython-311.pyc")
    assert _copies()["tools"] == "tools" and _copies()["pyproject.toml"] == "pyproject.toml"
    assert "docker/pip_guard.py" not in _copies()  # copied to /opt, outside the work directory
