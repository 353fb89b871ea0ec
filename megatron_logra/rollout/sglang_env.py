"""The process environment an in-process ``sglang.Engine`` starts in (:func:`engine_start_environment`), and
the trainer's SIGTERM handler kept while it runs (:class:`TrainerSignalEngine`).

``sglang.Engine`` spawns its scheduler processes from this process, which inherit its environment, and
its start-up rewrites some of this process's variables for its workers. The trainer runs under torchrun
and owns both: this module hides torchrun's variables while the engine starts (SGLang's schedulers run
their own process group) and puts the trainer's ``CUDA_*``/``NCCL_*`` values back once it has started.
The engine's first request also takes SIGTERM for SGLang's own shutdown (which ends the whole process);
every engine call made through :class:`TrainerSignalEngine` hands it back to the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = ["engine_start_environment", "reclaim_signal", "TrainerSignalEngine"]


_TRAINER_ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_NCCL_")
"""Variables SGLang's start overwrites in the caller's process for its workers (restored afterwards)."""
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_",)
"""What torchrun exports to its workers (hidden from SGLang's start, restored afterwards)."""


def _is_launcher_variable(key: str) -> bool:
    return key in _LAUNCHER_ENV or key.startswith(_LAUNCHER_ENV_PREFIXES)


@contextlib.contextmanager
def engine_start_environment() -> Iterator[None]:
    """The environment an in-process ``sglang.Engine`` starts in, and the trainer's afterwards.

    On entry, torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_*``, ``ROLE_*``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``) are taken out of
    this process's environment: the scheduler processes the constructor spawns inherit it, and their
    own ``init_process_group("tcp://127.0.0.1:<port>")`` must not see torchrun's. With
    ``TORCHELASTIC_USE_AGENT_STORE=True`` torch's rendezvous assumes torchrun's agent serves the
    store and makes every rank a TCPStore *client* (``_torchelastic_use_agent_store`` in
    ``torch/distributed/rendezvous.py``): nobody serves SGLang's store and the start hangs until
    its timeout.

    On exit (also when the constructor raises) they come back exactly as they were, absent ones
    absent, and so do the ``CUDA_*``, ``NCCL_*`` and ``TORCH_NCCL_*`` variables: SGLang's engine
    start (``_set_envs_and_config``) runs in the caller's process and overwrites
    ``CUDA_DEVICE_MAX_CONNECTIONS`` (Megatron wants 1), ``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``
    and ``TORCH_NCCL_AVOID_RECORD_STREAMS`` for its own workers. Those are started by the time the
    constructor returns, so the trainer's values hold for everything the trainer creates later
    (NCCL communicators, subprocesses). Other variables, SGLang's signal handlers and its
    multiprocessing start method are left as SGLang set them: its shutdown path needs them.
    """

    def managed(key: str) -> bool:
        return key.startswith(_TRAINER_ENV_PREFIXES) or _is_launcher_variable(key)

    before = {k: v for k, v in os.environ.items() if managed(k)}
    hidden = sorted(k for k in before if _is_launcher_variable(k))
    for key in hidden:
        del os.environ[key]
    if hidden:
        logger.info("sglang engine: starting without torchrun's %s (its schedulers run their own process group)",
                    ", ".join(hidden))
    try:
        yield
    finally:
        changed = []
        for key in [k for k in os.environ if managed(k) and k not in before]:
            changed.append(key)
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                if key not in hidden:
                    changed.append(key)
                os.environ[key] = value
        if changed:
            logger.info("sglang engine: restored the trainer's %s after the engine started", ", ".join(sorted(changed)))


def reclaim_signal(loop: Any, signum: int, handler: Any) -> bool:
    """Take ``signum`` back from the asyncio event loop ``loop`` and reinstall ``handler`` for it.

    True when ``loop`` had a handler of its own for ``signum`` (``loop.add_signal_handler``), which is then
    removed (``loop.remove_signal_handler``: the loop no longer acts on it) and ``handler`` (a
    ``signal.getsignal`` value; None, a handler not set from Python, becomes ``SIG_DFL``) put back; False,
    changing nothing, otherwise (no such handler, no loop, or not the main thread, where no handler can be
    set). The loop's other signals stay as they are."""
    remove = getattr(loop, "remove_signal_handler", None)
    if remove is None:
        return False
    try:
        if not remove(signum):
            return False
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or a closed loop
        return False
    return True


class TrainerSignalEngine:
    """An in-process ``sglang.Engine`` whose calls leave the trainer's SIGTERM handler in place.

    SGLang's ``TokenizerManager.auto_create_handle_loop`` (run by the engine's first request: generate,
    weight update or read; ``sglang/srt/managers/tokenizer_manager.py``, 0.4 to 0.5.x) registers, from the main
    thread, ``loop.add_signal_handler(SIGTERM, ...)`` on the engine's event loop: that replaces the process's
    SIGTERM handler (``train.exit_signal_handler``'s, which finishes the step and saves a checkpoint), and a
    SIGTERM then sets SGLang's ``gracefully_exit``, whose watchdog, the next time the engine's loop runs,
    kills the whole process tree, the trainer included, without a checkpoint. Each call through this wrapper
    records the SIGTERM handler before it and, after it, takes SIGTERM back from the engine's loop
    (:func:`reclaim_signal`). SGLang's SIGQUIT handler (its schedulers' crash notice) is kept. Attributes that
    are not callables (``server_args``) are the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.engine, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            before = signal.getsignal(signal.SIGTERM)
            try:
                return value(*args, **kwargs)
            finally:
                if reclaim_signal(getattr(self.engine, "loop", None), signal.SIGTERM, before):
                    logger.info("sglang engine: SIGTERM handed back to the trainer after %s", name)

        return call
