"""Stopping a run early and cleanly: on a signal (a cluster's preemption or time-limit notice) or
after a wall-time budget (Megatron-LM's ``--exit-signal-handler`` and ``--exit-duration-in-mins``).

The jobs check :meth:`EarlyStop.check` once after every step. A signal may reach some ranks only
(``scancel --signal`` to one task, one node's preemption) and clocks differ between hosts, so the
check is agreed over every rank (one all-reduce of a small tensor, only when a condition is
configured): every rank leaves the loop after the same step, they save that step's checkpoint
together and the job ends normally (exit status 0, ``summary["stopped"]`` naming why), ready for
``megatron-logra train --resume RUN_DIR``. The step in flight is finished first; a second signal
of the same kind within ``SAME_NOTICE_SECONDS`` is the same notice (Slurm signals every process of a
job step and torchrun forwards another copy); one after that ends the process at once.

The conditions stay in force after the last step: the jobs save its checkpoint first, then check
again (:meth:`EarlyStop.check_after_training`) before the final held-out evaluation, which a stop
skips, and once more after it. A signal that arrives during the final save or evaluation therefore
ends the job normally with its checkpoint written, instead of killing it.

Slurm signals every process of a job step (and ``kill -TERM -PGID`` a whole process group): the save a
stop asks for must not depend on a helper process outside this handler. The checkpoint writer has none
(:func:`megatron_logra.checkpoint.dist_writer._in_process_write_results`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_logra.parallel import collective_device, group_size

logger = logging.getLogger(__name__)

__all__ = ["EarlyStop", "STOP_SIGNAL", "catching_interrupts", "interrupted"]

STOP_SIGNAL = signal.SIGTERM
"""What ``train.exit_signal_handler`` catches: Slurm sends it at a job's time limit and on preemption
(``#SBATCH --signal=TERM@120`` asks for it 120 s ahead), Kubernetes when a pod is evicted."""


SAME_NOTICE_SECONDS = 10.0
"""Repeats of :data:`STOP_SIGNAL` this soon after the first are the same notice: Slurm signals every
process of a job step, and torchrun forwards its own copy to its workers at once. A later repeat ends
the process at once (the user insisting)."""


_interrupted = False
"""A SIGINT reached :func:`catching_interrupts`' handler (reset on entry)."""


def _on_interrupt(signum: int, frame: Optional[FrameType]) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a Ctrl-C (SIGINT) has reached :func:`catching_interrupts`' handler in the block now running: an
    error raised after it is its consequence (the ``KeyboardInterrupt`` landed inside library code that turned it
    into an error of its own, e.g. a checkpoint writer releasing a lock it no longer held)."""
    return _interrupted


@contextlib.contextmanager
def catching_interrupts() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside raises ``KeyboardInterrupt`` as Python's own handler does, and is remembered.

    Python drops an exception raised inside a finalizer (a weakref callback or ``__del__`` that the
    collector runs: "Exception ignored in ..."), so a Ctrl-C landing there would leave the run training;
    :meth:`EarlyStop.check`, which the jobs call after every step, raises it again (and the dropped one is not
    printed as "Exception ignored"). The previous handler and ``sys.unraisablehook`` are
    restored on exit. Outside the main thread (where no signal handler can be set) it does nothing."""
    global _interrupted
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _interrupted = False
    previous, previous_hook = signal.signal(signal.SIGINT, _on_interrupt), sys.unraisablehook

    def quiet_dropped_interrupt(unraisable: Any) -> None:
        if not (_interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            previous_hook(unraisable)  # the dropped Ctrl-C is raised again after the step: not worth a traceback

    sys.unraisablehook = quiet_dropped_interrupt
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        _interrupted = False


class EarlyStop:
    """The stop conditions of one run, used as a context manager around its training loop (the
    signal handler is installed on entry and the previous one restored on exit).

    ``signal_handler``: catch :data:`STOP_SIGNAL` and stop after the step in flight.
    ``duration_minutes``: stop after the first step that ends this many minutes after ``start``
    (a ``time.monotonic()`` value; default: construction); 0 = no budget.
    ``group``: the ranks that agree (default: every rank; None without a process group)."""

    def __init__(self, *, signal_handler: bool, duration_minutes: float, start: Optional[float] = None,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        if duration_minutes < 0:
            raise ValueError(f"duration_minutes={duration_minutes} must be >= 0 (0 = no budget)")
        self.signal_handler = signal_handler
        self.duration_minutes = float(duration_minutes)
        self.start = time.monotonic() if start is None else start
        self.group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.received = False
        self._first_signal: Optional[float] = None
        self._previous = None

    @property
    def enabled(self) -> bool:
        return self.signal_handler or self.duration_minutes > 0

    def __enter__(self) -> "EarlyStop":
        if self.signal_handler:
            self._previous = signal.signal(STOP_SIGNAL, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.signal_handler and self._previous is not None:
            signal.signal(STOP_SIGNAL, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        now = time.monotonic()
        if self._first_signal is None:
            self.received, self._first_signal = True, now
            logger.warning("received %s: stopping after the step in flight (its checkpoint is saved); send it "
                           "again after %g s to stop at once", signal.Signals(signum).name, SAME_NOTICE_SECONDS)
        elif now - self._first_signal > SAME_NOTICE_SECONDS:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def check(self) -> Optional[str]:
        """Why every rank stops now (``"SIGTERM"`` or ``"exit_duration_minutes=M"``), or None to go on.
        Collective over ``group`` whenever a condition is configured: every rank calls it after every step.
        A Ctrl-C that Python dropped (:func:`catching_interrupts`) is raised here as ``KeyboardInterrupt``."""
        if _interrupted:
            raise KeyboardInterrupt
        if not self.enabled:
            return None
        over = self.duration_minutes > 0 and (time.monotonic() - self.start) / 60 >= self.duration_minutes
        flags = torch.tensor([float(self.received), float(over)])
        if group_size(self.group) > 1:
            on = flags.to(collective_device(self.group))
            dist.all_reduce(on, op=dist.ReduceOp.MAX, group=self.group)
            flags = on.cpu()
        if flags[0] > 0:
            return STOP_SIGNAL.name
        if flags[1] > 0:
            return f"exit_duration_minutes={self.duration_minutes:g}"
        return None

    def check_after_training(self, during: str) -> Optional[str]:
        """:meth:`check` once the loop is over and the last step's checkpoint is saved (collective like
        :meth:`check`: every rank calls it at the same point), logging a stop asked for ``during`` the
        final save or evaluation (nothing is lost: the job skips what is left and ends normally)."""
        stopped = self.check()
        if stopped is not None:
            logger.warning("%s during %s: the checkpoint of the last step is saved; ending now", stopped, during)
        return stopped
