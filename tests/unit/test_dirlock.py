"""Directory locks: one holder at a time, released however the holder ends, never kept by a forked child."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

from megatron_logra.dirlock import lock_directory, release_directory

PROBE = ("import sys; from megatron_logra.dirlock import lock_directory; "
         "print(lock_directory(sys.argv[1]))")


def _taken_by_another_process(path) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_one_holder_then_released(tmp_path):
    assert lock_directory(tmp_path) and lock_directory(tmp_path)  # again in the same process: still held
    try:
        assert not _taken_by_another_process(tmp_path)
    finally:
        release_directory(tmp_path)
    assert _taken_by_another_process(tmp_path)


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """A checkpoint writer forked while the job holds the lock must not hold it once the job lets go (or dies)."""
    assert lock_directory(tmp_path)
    child = multiprocessing.get_context("fork").Process(target=_sleep, args=(30,))
    child.start()
    try:
        release_directory(tmp_path)  # the job's own descriptor closed, as when the job is killed
        assert _taken_by_another_process(tmp_path), "the forked child kept the directory's lock"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
