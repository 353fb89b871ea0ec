"""An in-process SGLang engine leaves the trainer's SIGTERM handler in place (``rollout.sglang_env``).

SGLang's ``TokenizerManager.auto_create_handle_loop`` (``sglang/srt/managers/tokenizer_manager.py``, 0.4 to
0.5.x), run by the engine's first request from the main thread, registers ``loop.add_signal_handler(SIGTERM,
SignalHandler.sigterm_handler)`` and ``loop.add_signal_handler(SIGQUIT, running_phase_sigquit_handler)`` on
the engine's event loop (``Engine.loop``). ``sigterm_handler`` sets ``gracefully_exit``, and the
``sigterm_watchdog`` task then kills the whole process tree the next time the loop runs. The stand-in below
does exactly that registration on its first call, on a real asyncio loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from megatron_logra.rollout.sglang_env import TrainerSignalEngine, reclaim_signal

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGQUIT"), reason="POSIX signals")


class _EngineLike:
    """``sglang.Engine``'s shape here: ``loop`` (its event loop), ``server_args``, and calls that run a
    request on that loop, the first of which registers SGLang's SIGTERM / SIGQUIT handlers on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server_args = object()
        self.sglang_sigterm = 0
        self.sglang_sigquit = 0
        self._handle_loop = False

    def _auto_create_handle_loop(self) -> None:
        if self._handle_loop:
            return
        self._handle_loop = True
        if threading.current_thread() is threading.main_thread():
            self.loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
            self.loop.add_signal_handler(signal.SIGQUIT, self._on_sigquit)

    def _on_sigterm(self) -> None:
        self.sglang_sigterm += 1

    def _on_sigquit(self) -> None:
        self.sglang_sigquit += 1

    def generate(self, **payload):
        self._auto_create_handle_loop()
        return self.loop.run_until_complete(asyncio.sleep(0, result=[payload]))

    def run_loop(self) -> None:
        """What the engine's next request does: run its loop (which then handles the signals it holds)."""
        self.loop.run_until_complete(asyncio.sleep(0.05))

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGQUIT):
            self.loop.remove_signal_handler(sig)
        self.loop.close()


@pytest.fixture
def trainer_sigterm():
    """The trainer's SIGTERM handler (``train.stopping.EarlyStop``'s role), restored afterwards."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    previous_quit = signal.getsignal(signal.SIGQUIT)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGQUIT, previous_quit)


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the Python-level handler runs between bytecodes of the main thread
        pass


def test_engine_calls_keep_the_trainers_sigterm_handler(trainer_sigterm):
    engine = _EngineLike()
    wrapped = TrainerSignalEngine(engine)
    try:
        mine = signal.getsignal(signal.SIGTERM)
        assert wrapped.generate(input_ids=[[1]]) == [{"input_ids": [[1]]}]
        assert signal.getsignal(signal.SIGTERM) is mine  # SGLang's registration was taken back
        assert wrapped.server_args is engine.server_args
        _deliver(signal.SIGTERM)
        assert trainer_sigterm == [signal.SIGTERM]
        engine.run_loop()
        assert engine.sglang_sigterm == 0  # SGLang's shutdown never sees it
        assert wrapped.generate(input_ids=[[2]]) and signal.getsignal(signal.SIGTERM) is mine
        _deliver(signal.SIGQUIT)  # its schedulers' crash notice stays SGLang's
        engine.run_loop()
        assert engine.sglang_sigquit == 1
    finally:
        engine.close()


def test_without_the_wrapper_sglang_takes_sigterm(trainer_sigterm):
    """What the wrapper prevents: after the engine's first request SIGTERM reaches SGLang's handler only."""
    engine = _EngineLike()
    try:
        engine.generate(input_ids=[[1]])
        _deliver(signal.SIGTERM)
        engine.run_loop()
        assert trainer_sigterm == [] and engine.sglang_sigterm == 1
    finally:
        engine.close()


def test_reclaim_signal_changes_nothing_where_the_loop_holds_no_handler(trainer_sigterm):
    loop = asyncio.new_event_loop()
    try:
        mine = signal.getsignal(signal.SIGTERM)
        assert reclaim_signal(loop, signal.SIGTERM, signal.SIG_DFL) is False
        assert signal.getsignal(signal.SIGTERM) is mine
        assert reclaim_signal(None, signal.SIGTERM, signal.SIG_DFL) is False
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        assert reclaim_signal(loop, signal.SIGTERM, None) is True  # a handler not set from Python: the default
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        loop.close()
