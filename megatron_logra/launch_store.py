"""Rank 0 telling the other ranks of a torchrun launch, on every node, that it has reported an error.

A refused config fails on every rank alike; rank 0 reports it and the others stay silent
(``megatron_logra.cli``'s error reporting). On one node torchrun stops the other ranks as soon as rank 0 has
failed; on another node its torchrun learns of the failure later (through the rendezvous), so waiting a fixed
time is not enough there. Before any process group exists, the ranks of every node can already reach one
store: the one torchrun's agent on the first node hosts for them at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``, with the static and the c10d rendezvous alike). Rank 0 sets a key there
once it has reported (:func:`announce_error_reported`); the others wait for that key
(:func:`rank0_reported_error`) and, when it comes, say so and stop without a word. Rank 0 waits for them
to have seen it before it exits (the first node's torchrun ends that store soon after its ranks have ended).

Without that store (another launcher, one process) nothing is set and the others wait the whole time given.
Imports ``torch.distributed`` only when the store exists.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Optional

__all__ = ["announce_error_reported", "rank0_reported_error", "reported_error_key"]

_POLL_SECONDS = 0.05
"""How often a waiting rank looks for the key."""

_CONNECT_SECONDS = 5.0
"""Longest rank 0 tries to reach the store to set the key (it has already reported)."""


def reported_error_key() -> str:
    """The key rank 0 sets: one per attempt of the launch (``TORCHELASTIC_RESTART_COUNT``), so that the ranks of a
    restarted attempt do not take an earlier attempt's report for their own."""
    return f"megatron_logra/error_reported/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0').strip() or '0'}"


def _agent_store(timeout_s: float) -> Optional[Any]:
    """A client of the store torchrun's agent hosts for its workers, or None: not launched by a torchrun agent
    that shares its store, no usable ``MASTER_ADDR`` / ``MASTER_PORT``, or not reachable within ``timeout_s``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") != "True":
        return None
    host, port = os.environ.get("MASTER_ADDR", "").strip(), os.environ.get("MASTER_PORT", "").strip()
    if not host or not port.isdigit():
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=datetime.timedelta(seconds=max(timeout_s, 0.1)))
    except (RuntimeError, OSError, ValueError):  # DistStoreError / DistNetworkError are RuntimeErrors
        return None


def _seen_key() -> str:
    return reported_error_key() + "/seen"


def _peers() -> int:
    """How many other ranks the launch has (``WORLD_SIZE - 1``; 0 when unknown)."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "").strip()) - 1, 0)
    except ValueError:
        return 0


def announce_error_reported(wait_s: float = 0.0) -> bool:
    """Set :func:`reported_error_key` in the launch's store (rank 0, once it has written its report), then wait up
    to ``wait_s`` seconds until every other rank has seen it (those that met the same error; the others never
    look); whether it was set. Best effort: without the store, or when it cannot be reached, the others wait as
    before."""
    store = _agent_store(_CONNECT_SECONDS)
    if store is None:
        return False
    deadline = time.monotonic() + wait_s
    try:
        store.set(reported_error_key(), "1")
        while store.add(_seen_key(), 0) < _peers() and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    except (RuntimeError, OSError):
        pass
    return True


def rank0_reported_error(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for rank 0's :func:`announce_error_reported`; True as soon as it is seen.
    False after the whole wait when it never came, when there is no store, or when the store went away (the
    first node's torchrun ended) before the key was seen: the caller then reports its error itself."""
    deadline = time.monotonic() + timeout_s
    store = _agent_store(timeout_s)
    key = reported_error_key()
    while store is not None:
        try:
            if store.check([key]):
                store.add(_seen_key(), 1)  # rank 0 waits for every rank to have seen it
                return True
        except (RuntimeError, OSError):  # the store is gone
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
    time.sleep(max(0.0, deadline - time.monotonic()))
    return False
