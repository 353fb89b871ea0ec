"""Rank 0 announcing its error report to the other ranks through the store torchrun's agent shares with every
node (``megatron_logra.launch_store``), against a real ``TCPStore`` server in this process."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from megatron_logra import launch_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent_store(monkeypatch):
    """A store as torchrun's agent hosts it, and a worker's environment pointing at it (WORLD_SIZE 2)."""
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    yield server


def test_without_the_agent_store_the_others_wait_the_whole_time(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert launch_store.announce_error_reported() is False
    t0 = time.monotonic()
    assert launch_store.rank0_reported_error(0.3) is False
    assert time.monotonic() - t0 >= 0.3


def test_unreachable_store_is_no_announcement(agent_store, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nothing listens there
    assert launch_store.rank0_reported_error(0.5) is False


def test_the_others_see_rank0s_announcement_at_once(agent_store):
    assert launch_store.announce_error_reported() is True
    t0 = time.monotonic()
    assert launch_store.rank0_reported_error(10.0) is True
    assert time.monotonic() - t0 < 5.0


def test_an_earlier_attempts_announcement_is_not_this_ones(agent_store, monkeypatch):
    assert launch_store.announce_error_reported() is True
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch_store.rank0_reported_error(0.3) is False


def test_rank0_waits_until_the_others_have_seen_it(agent_store):
    """The first node's torchrun ends the store soon after rank 0 ends: rank 0 leaves once every other rank
    (WORLD_SIZE - 1 of them) has seen the announcement, not before, and not after."""
    seen = []
    peer = threading.Thread(target=lambda: (time.sleep(0.5), seen.append(launch_store.rank0_reported_error(10.0))))
    peer.start()
    t0 = time.monotonic()
    assert launch_store.announce_error_reported(wait_s=10.0) is True
    waited = time.monotonic() - t0
    peer.join()
    assert seen == [True] and 0.4 <= waited < 5.0, waited
    # with no other rank looking it gives up after wait_s
    agent_store.delete_key(launch_store.reported_error_key() + "/seen")
    t0 = time.monotonic()
    launch_store.announce_error_reported(wait_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3.0
