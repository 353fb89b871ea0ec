"""Profiling a window of training steps: a ``torch.profiler`` trace, or an Nsight Systems capture range.

A run profiles the steps ``profile.step_start <= step < profile.step_end`` (1-based, the numbers in
``metrics.jsonl``; Megatron-LM's ``--profile-step-start`` / ``--profile-step-end``) on the ranks in
``profile.ranks``. The training loops call :meth:`StepProfiler.step` around every step and label their
phases with :func:`phase`, so a trace shows rollout, reward, forward/backward, KL control, apply and sync as
named ranges.

* ``tool=torch`` writes, per profiled rank, ``RUN/profile/rank{R}-steps{A}-{B}.json.gz`` (a Chrome trace:
  open it in https://ui.perfetto.dev or ``chrome://tracing``) and ``rank{R}-steps{A}-{B}.txt`` (the ops and
  phases by self time, the table of ``torch.profiler``'s ``key_averages``).
* ``tool=nsys`` calls ``cudaProfilerStart`` / ``cudaProfilerStop`` around the window and emits NVTX ranges
  for every autograd op and phase; run the job under
  ``nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`` so only the window is captured.

Profiling is a diagnostic: a trace that cannot be written (a full disk) is logged as an error and the run goes
on. What the config asks for that cannot work (an nsys capture without CUDA, a rank the job does not have) is
refused before the model is built, by :func:`check_profile`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["ProfileConfig", "StepProfiler", "Phases", "phase", "check_profile", "check_job_profile", "job_profiler"]

TOOLS = ("torch", "nsys")


@dataclass
class ProfileConfig:
    """Which steps and ranks to profile, and with what (Megatron-LM: ``--profile``, ``--use-pytorch-profiler``,
    ``--profile-step-start``, ``--profile-step-end``, ``--profile-ranks``, ``--pytorch-profiler-collect-shapes``,
    ``--pytorch-profiler-collect-callstack``)."""

    enabled: bool = False
    """Profile the window ``[step_start, step_end)`` (--profile). Off, the loops pay only for the phase labels
    (a ``record_function`` per phase, a few per step)."""
    tool: str = "torch"
    """``torch``: a ``torch.profiler`` trace and op table per profiled rank under ``RUN/profile``
    (--use-pytorch-profiler); ``nsys``: a CUDA profiler capture range with NVTX ranges, for a job run under
    ``nsys profile --capture-range=cudaProfilerApi`` (CUDA only)."""
    step_start: int = 10
    """First profiled step (1-based, as in metrics.jsonl; --profile-step-start). Leave a few steps before it:
    the first steps allocate, compile and warm caches."""
    step_end: int = 12
    """First step after the window (--profile-step-end): ``step_end - step_start`` steps are profiled."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that profile (--profile-ranks); each writes its own files."""
    record_shapes: bool = False
    """Record the input shapes of every op (--pytorch-profiler-collect-shapes); larger traces."""
    profile_memory: bool = False
    """Record tensor allocations and frees in the trace (``tool=torch``)."""
    with_stack: bool = False
    """Record the Python stack of every op (``tool=torch``; --pytorch-profiler-collect-callstack); much larger
    traces, slower steps."""

    def __post_init__(self) -> None:
        for name in ("enabled", "record_shapes", "profile_memory", "with_stack"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"profile.{name}={getattr(self, name)!r} must be true or false")
        if self.tool not in TOOLS:
            raise ValueError(f"profile.tool={self.tool!r}: choose torch (a torch.profiler trace) or nsys "
                             f"(a capture range for `nsys profile --capture-range=cudaProfilerApi`)")
        for name in ("step_start", "step_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"profile.{name}={value!r} must be a step number >= 1")
        if self.step_end <= self.step_start:
            raise ValueError(f"profile.step_end={self.step_end} must be > profile.step_start={self.step_start}: "
                             f"the window is [step_start, step_end), e.g. profile.step_end={self.step_start + 2}")
        if isinstance(self.ranks, (int, str)) or not isinstance(self.ranks, (list, tuple)) or not self.ranks or \
                any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.ranks):
            raise ValueError(f"profile.ranks={self.ranks!r} must be a non-empty list of global ranks >= 0, "
                             f"e.g. profile.ranks=0 or profile.ranks=0,8")
        self.ranks = sorted(set(self.ranks))


def check_profile(cfg: ProfileConfig, world_size: int, *, cuda: bool) -> None:
    """Refuse, before anything is built, a profile this job cannot take: a rank outside ``[0, world_size)``,
    or ``tool=nsys`` without CUDA (``cuda``: the job trains on CUDA devices). Nothing is checked while
    ``cfg.enabled`` is false."""
    if not cfg.enabled:
        return
    missing = [r for r in cfg.ranks if r >= world_size]
    if missing:
        raise ValueError(f"profile.ranks={cfg.ranks}: the job has {world_size} rank(s), so rank(s) {missing} do not "
                         f"exist; choose ranks below {world_size}")
    if cfg.tool == "nsys" and not cuda:
        raise ValueError("profile.tool=nsys needs a CUDA device (it marks a CUDA profiler capture range); "
                         "on this machine use profile.tool=torch")


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_job_profile(cfg: ProfileConfig) -> None:
    """:func:`check_profile` in a job: against the process group's world size (1 without one), CUDA when a
    device is present (the jobs train on it then). Call it before building the model, so a refused profile
    costs no build."""
    check_profile(cfg, _rank_and_world()[1], cuda=torch.cuda.is_available())


def job_profiler(cfg: ProfileConfig, run_dir: str | Path) -> StepProfiler:
    """The :class:`StepProfiler` of this process in a job (global rank from the process group), after
    :func:`check_job_profile`."""
    check_job_profile(cfg)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return StepProfiler(cfg, run_dir, rank=_rank_and_world()[0], device=device)


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


class StepProfiler:
    """Opens the profile window at ``cfg.step_start`` and closes it after ``cfg.step_end - 1``.

    One per process: ``with profiler.step(n): ...`` around step ``n``; :meth:`close` when the loop ends
    (it closes a window a run left early, writing what was recorded). Inactive (every call a no-op) when
    profiling is off or ``rank`` is not in ``cfg.ranks``. A window that lies wholly before the first step this
    process runs (a resumed run) is skipped with a warning; one that a resume enters midway profiles the
    steps that are left of it; one that starts after the last step this process ran (a run shorter than
    ``cfg.step_start``, or stopped early) is reported by :meth:`close` with a warning.
    """

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, *, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.active = cfg.enabled and rank in cfg.ranks
        self.out_dir = Path(run_dir) / "profile"
        self.written: list[Path] = []
        """The files the window wrote (empty until it closes, and for ``tool=nsys``)."""
        self._prof: Optional[torch.profiler.profile] = None
        self._nvtx: Optional[contextlib.AbstractContextManager] = None
        self._first: Optional[int] = None
        self._last: Optional[int] = None
        self._ran: Optional[int] = None  # the last step this process ran, profiled or not
        self._done = False

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile step ``step`` (1-based) if it is in the window: the window opens before the first such
        step and closes after the last one, or after a step that raises (its files then hold the steps up to
        and including the failed one)."""
        if not self.active or self._done:
            yield
            return
        self._ran = step
        if self._first is None:
            if step >= self.cfg.step_end:
                logger.warning("profile window [%d, %d) lies before step %d, where this run starts: nothing is "
                               "profiled (set profile.step_start / profile.step_end to later steps)",
                               self.cfg.step_start, self.cfg.step_end, step)
                self._done = True
                yield
                return
            if step >= self.cfg.step_start:
                self._open(step)
        failed = True
        try:
            yield
            failed = False
        finally:
            if self._first is not None and not self._done:
                self._last = step
                if failed or step + 1 >= self.cfg.step_end:  # a step that raised: keep what led up to it
                    self.close()

    def close(self) -> None:
        """Close an open window and write its files. With none open, a no-op, but for a warning when steps ran
        and the window was never reached (it starts after the last of them)."""
        if self._first is None and not self._done and self._ran is not None:
            self._done = True
            logger.warning("profile window [%d, %d) starts after step %d, the last this run ran: nothing is "
                           "profiled (set profile.step_start to a step the run reaches, or raise its steps)",
                           self.cfg.step_start, self.cfg.step_end, self._ran)
        if self._first is None or self._done:
            return
        self._done = True
        try:
            if self._prof is not None:
                self._synchronize()
                self._prof.stop()
                self._write_torch()
            if self._nvtx is not None:
                self._stop_nsys()
        except Exception:  # a diagnostic: the run goes on without it
            logger.exception("rank %d: profiling steps %d-%s failed; the run goes on without the profile",
                             self.rank, self._first, self._last)
        finally:
            self._prof = None

    def _open(self, step: int) -> None:
        self._first = step
        try:
            if self.cfg.tool == "nsys":
                self._start_nsys()
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._synchronize()
            self._prof = torch.profiler.profile(activities=activities, record_shapes=self.cfg.record_shapes,
                                                profile_memory=self.cfg.profile_memory,
                                                with_stack=self.cfg.with_stack)
            self._prof.start()
        except Exception:
            logger.exception("rank %d: could not start the profiler at step %d; the run goes on without it",
                             self.rank, step)
            self._prof, self._done = None, True
            return
        logger.info("rank %d: profiling steps %d-%d (%s)", self.rank, step, self.cfg.step_end - 1, self.cfg.tool)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write_torch(self) -> None:
        assert self._prof is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank{self.rank}-steps{self._first}-{self._last}"
        trace = stem.with_name(stem.name + ".json.gz")
        self._prof.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        averages = self._prof.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=40)
        table_path = stem.with_name(stem.name + ".txt")
        num_steps = self._last - self._first + 1
        table_path.write_text(f"steps {self._first}-{self._last}, rank {self.rank}\n\n"
                              f"{phase_table(averages, num_steps)}\nops and ranges, sorted by {sort_by}:\n{table}\n",
                              encoding="utf-8")
        self.written = [trace, table_path]
        logger.info("rank %d: profile of steps %d-%d written to %s (open the .json.gz in https://ui.perfetto.dev) "
                    "and %s", self.rank, self._first, self._last, trace, table_path.name)

    def _start_nsys(self) -> None:
        self._synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.cfg.record_shapes)
        self._nvtx.__enter__()  # NVTX ranges for every op and every record_function range, the phases among them

    def _stop_nsys(self) -> None:
        self._synchronize()
        assert self._nvtx is not None
        self._nvtx.__exit__(None, None, None)
        self._nvtx = None
        torch.cuda.cudart().cudaProfilerStop()
        logger.info("rank %d: nsys capture range closed after step %s", self.rank, self._last)
