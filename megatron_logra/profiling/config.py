"""What to profile (:class:`ProfileConfig`, the ``profile.*`` section) and what a job refuses of it before anything
is built (:func:`check_profile`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ProfileConfig", "check_profile", "TOOLS"]

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
