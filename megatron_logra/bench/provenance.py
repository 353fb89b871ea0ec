"""The provenance a paper-bench report states in its header: the command that reproduces it and the machine.

:func:`command_line` is ``megatron-logra bench paper`` with every flag whose value differs from the preset's,
so a reader can rerun exactly that report; :func:`environment` is recorded in the run's JSON at run time (not
when re-rendering), so a report re-rendered elsewhere still names the machine it was measured on.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
from typing import Any, Optional

from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.report_names import plain_settings

logger = logging.getLogger(__name__)

__all__ = ["LEGACY_ENVIRONMENT", "command_line", "cpu_model", "environment", "describe_environment"]

LEGACY_ENVIRONMENT = "OMP_NUM_THREADS=1, {threads} torch thread(s), x86_64 CPU, shared 2-core machine"
"""The machine of reports whose JSON predates the recorded environment (the project's shared 2-core x86_64
machine, where the committed reports were measured)."""


def command_line(cfg: PaperBenchConfig) -> str:
    """The ``megatron-logra bench paper`` command that runs ``cfg``: ``--quick`` and every flag whose value
    differs from the preset's; settings no flag reaches (set through the API) are listed after it."""
    from megatron_logra.bench.cli import build_parser, config_from_args

    preset = PaperBenchConfig.preset(cfg.quick)
    args = ["paper"] + (["--quick"] if cfg.quick else [])
    for flag, name in (("--out-dir", "out_dir"), ("--run-root", "run_root")):
        if getattr(cfg, name) != getattr(preset, name):
            args += [flag, getattr(cfg, name)]
    for flag, name in (("--figures", "figures"), ("--optimizers", "optimizers"), ("--kl-modes", "kl_modes"),
                       ("--seeds", "seeds")):
        if list(getattr(cfg, name)) != list(getattr(preset, name)):
            args += [flag, *map(str, getattr(cfg, name))]
    if cfg.rl_steps != preset.rl_steps:
        args += ["--rl-steps", str(cfg.rl_steps)]
    text = shlex.join(["megatron-logra", "bench", *args])
    rebuilt, wanted = plain_settings(config_from_args(build_parser().parse_args(args))), plain_settings(cfg)
    rest = [f"{k}={wanted[k]!r}" for k in wanted if wanted[k] != rebuilt[k]]
    return text + (f" (and, through the API: {', '.join(rest)})" if rest else "")


def cpu_model() -> str:
    """The CPU's model name: the first ``model name`` of ``/proc/cpuinfo``; where that file or line is missing
    (not Linux, some ARM kernels), ``platform.processor()``, else ``platform.machine()``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu


def environment(threads: int) -> dict[str, Any]:
    """The machine a run is on, as the report's header states it: CPU, cores, ``OMP_NUM_THREADS``, the
    torch threads (``threads``), torch and Python versions, and the load average now."""
    import torch

    return {"omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "torch_threads": threads,
            "machine": platform.machine(), "cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def describe_environment(env: Optional[dict[str, Any]], threads: int) -> str:
    """``env`` (what :func:`environment` recorded) as the report's header words; None (a JSON from before the
    environment was recorded): :data:`LEGACY_ENVIRONMENT` with ``threads``."""
    if env is None:
        return LEGACY_ENVIRONMENT.format(threads=threads)
    load = env.get("load_average")
    return (f"OMP_NUM_THREADS={env['omp_num_threads']}, {env['torch_threads']} torch thread(s), {env['cpu']} "
            f"({env['machine']}, {env['cpu_count']} cores"
            + (f", load average {load:.1f} at the start" if load is not None else "")
            + f"), torch {env['torch']}")
