"""The profile window of one process: :class:`StepProfiler` opens the profiler before ``profile.step_start`` and
writes its files after ``profile.step_end - 1``; :func:`job_profiler` builds it for a job's rank."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatron_logra.parallel import group_rank, group_size, world_group
from megatron_logra.profiling.config import ProfileConfig, check_profile
from megatron_logra.profiling.phases import phase_table

logger = logging.getLogger(__name__)

__all__ = ["StepProfiler", "check_job_profile", "job_profiler"]


def check_job_profile(cfg: ProfileConfig) -> None:
    """:func:`check_profile` in a job: against the process group's world size (1 without one), CUDA when a
    device is present (the jobs train on it then). Call it before building the model, so a refused profile
    costs no build."""
    check_profile(cfg, group_size(world_group()), cuda=torch.cuda.is_available())


def job_profiler(cfg: ProfileConfig, run_dir: str | Path) -> StepProfiler:
    """The :class:`StepProfiler` of this process in a job (global rank from the process group), after
    :func:`check_job_profile`."""
    check_job_profile(cfg)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return StepProfiler(cfg, run_dir, rank=group_rank(world_group()), device=device)


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
