"""Which files a write made durable: the tests of atomic saves check that every file is synced before it is named."""

from __future__ import annotations

import os


def record_fsyncs(monkeypatch) -> list[str]:
    """Patch ``os.fsync`` (for the test's duration) to record the path of every descriptor it flushes, in order;
    returns the list it appends to."""
    calls: list[str] = []
    real = os.fsync

    def recording_fsync(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls
