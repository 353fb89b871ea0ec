"""Rank 0 announcing its error report to the other ranks through the store torchrun's agent shares with every
node (``megatron_logra.launch_store``), against a real ``TCPStore`` server in this process.

How long a rank waits is checked on a virtual clock (:class:`_Clock`, the module's ``time``), never the wall
clock: exact, and the same on a loaded machine."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from megatron_logra import launch_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Clock:
    """Stands in for ``launch_store``'s ``time`` module: ``monotonic`` is virtual seconds since the start, ``sleep``
    advances them (without waiting) and then runs the actions due by then (``at``: another rank doing something at
    that time)."""

    def __init__(self):
        self.now = 0.0
        self.due: list = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds
        while self.due and self.due[0][0] <= self.now:
            self.due.pop(0)[1]()

    def at(self, when: float, action) -> None:
        self.due = sorted([*self.due, (when, action)], key=lambda d: d[0])


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(launch_store, "time", clock)
    return clock


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


def test_without_the_agent_store_the_others_wait_the_whole_time(monkeypatch, clock):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert launch_store.announce_error_reported() is False
    assert clock.now == 0.0
    assert launch_store.rank0_reported_error(0.3) is False
    assert clock.now == pytest.approx(0.3)


def test_unreachable_store_is_no_announcement(agent_store, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nothing listens there
    assert launch_store.rank0_reported_error(0.5) is False


def test_the_others_see_rank0s_announcement_at_once(agent_store, clock):
    assert launch_store.announce_error_reported() is True
    assert launch_store.rank0_reported_error(10.0) is True
    assert clock.now == 0.0  # not a moment's wait


def test_an_earlier_attempts_announcement_is_not_this_ones(agent_store, monkeypatch):
    assert launch_store.announce_error_reported() is True
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch_store.rank0_reported_error(0.3) is False


def test_rank0_waits_until_the_others_have_seen_it(agent_store, clock):
    """The first node's torchrun ends the store soon after rank 0 ends: rank 0 leaves once every other rank
    (WORLD_SIZE - 1 of them) has seen the announcement, not before, and not after."""
    poll = launch_store._POLL_SECONDS
    seen = []
    clock.at(0.5, lambda: seen.append(launch_store.rank0_reported_error(10.0)))  # the other rank looks at 0.5 s
    assert launch_store.announce_error_reported(wait_s=10.0) is True
    assert seen == [True]
    assert 0.5 <= clock.now <= 0.5 + poll + 1e-9, clock.now
    # with no other rank looking it gives up after wait_s
    agent_store.delete_key(launch_store.reported_error_key() + "/seen")
    t0 = clock.now
    assert launch_store.announce_error_reported(wait_s=0.3) is True
    assert 0.3 <= clock.now - t0 <= 0.3 + poll + 1e-9, clock.now - t0
