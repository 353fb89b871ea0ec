"""Named phases of a training step: ``record_function`` ranges that a ``torch.profiler`` trace shows (and an nsys
capture, through ``emit_nvtx``), and their totals as a text table."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

__all__ = ["phase", "Phases", "phase_table"]

_PHASE_NAMES: set[str] = set()  # every label phase() / Phases.next() has opened in this process


def phase_table(averages, num_steps: int) -> str:
    """The phases (:func:`phase`, :class:`Phases`) among ``torch.profiler`` ``key_averages()``, as a text table:
    calls, total and per-step host wall time of each range, and its share of all phases' time (nested phases
    count in both). Empty when no phase ran in the window."""
    rows = sorted(((e.key, e.count, e.cpu_time_total / 1e3) for e in averages if e.key in _PHASE_NAMES),
                  key=lambda row: -row[2])
    if not rows:
        return ""
    total = sum(ms for _, _, ms in rows) or 1.0
    lines = [f"phases (host wall time of each range, {num_steps} step(s)):",
             f"{'phase':<28} {'calls':>6} {'ms total':>10} {'ms/step':>9} {'share':>7}"]
    lines += [f"{name:<28} {calls:>6} {ms:>10.1f} {ms / num_steps:>9.1f} {ms / total:>7.1%}" for name, calls, ms in rows]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label a phase of a step (``rl/rollout``, ``rl/backward``, ...) in a trace.

    A ``torch.profiler.record_function`` range: a range of the torch trace, and an NVTX range while an nsys
    window is open (``emit_nvtx`` turns every ``record_function`` range into one). Costs a few microseconds when
    nothing profiles."""
    _PHASE_NAMES.add(name)
    with torch.profiler.record_function(name):
        yield


class Phases:
    """Consecutive phases of one step, each a :func:`phase`-style range: ``ph.next("reward")`` ends the
    phase in progress and starts ``PREFIX/reward``; leaving the ``with`` block ends the last one, also on an
    early return or an exception. Lets a loop body keep its top-to-bottom shape instead of nesting a
    ``with`` block per phase."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._range: Optional[torch.profiler.record_function] = None

    def __enter__(self) -> "Phases":
        return self

    def __exit__(self, *exc) -> None:
        self._end()

    def next(self, name: str) -> None:
        """End the phase in progress (if any) and start ``PREFIX/name``."""
        self._end()
        label = f"{self.prefix}/{name}"
        _PHASE_NAMES.add(label)
        self._range = torch.profiler.record_function(label)
        self._range.__enter__()

    def _end(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
