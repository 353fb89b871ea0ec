"""Running a call on a thread other than the main one (where ``signal.alarm`` and the main-thread reward deadline do
not apply), for the tests of the reward time limits."""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["in_thread"]


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a new (non-main) thread; its value, or its exception raised here."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]
