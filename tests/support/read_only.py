"""A read-only run directory, as a read-only mount or an unwritable share gives it: for root (whom file modes do
not stop) a read-only bind mount of the directory onto itself, else ``chmod a-w``; a test skips where neither is
possible."""

from __future__ import annotations

import os
import stat
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@contextmanager
def read_only(directory: Path):
    """``directory`` (and everything in it) cannot be written inside the ``with`` block; restored after it."""
    directory = Path(directory)
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")] if p.is_dir()}
        for p, mode in modes.items():
            p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    if not _run("mount", "--bind", str(directory), str(directory)):
        pytest.skip("cannot bind-mount a directory read-only here (mount --bind needs CAP_SYS_ADMIN)")
    try:
        if not _run("mount", "-o", "remount,ro,bind", str(directory)):
            pytest.skip("cannot remount a bind mount read-only here")
        probe = directory / ".probe"
        try:
            probe.write_text("x")
        except OSError:
            pass
        else:
            probe.unlink()
            pytest.skip("a read-only bind mount is still writable here")
        yield
    finally:
        if not _run("umount", str(directory)):  # busy: this process (or a child) still holds a file of it
            _run("umount", "-l", str(directory))  # detached, so that no mount outlives the test
            raise AssertionError(f"{directory} was still in use after the read-only block: a file of it is held "
                                 "open or mapped (see /proc/self/maps)")
