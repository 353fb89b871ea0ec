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


from megatron_logra.profiling.config import ProfileConfig, check_profile
from megatron_logra.profiling.phases import Phases, phase, phase_table
from megatron_logra.profiling.window import StepProfiler, check_job_profile, job_profiler

__all__ = ["ProfileConfig", "StepProfiler", "Phases", "phase", "phase_table", "check_profile", "check_job_profile",
           "job_profiler"]
