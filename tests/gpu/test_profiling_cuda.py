"""The profile window on a CUDA device: CUDA kernels in the torch trace, and the nsys capture range.

Outside ``nsys profile`` the CUDA profiler calls are no-ops, so the nsys tool's window opens and closes
cleanly here; what the capture holds is checked only under nsys itself. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.profiling import ProfileConfig, StepProfiler, check_profile, phase

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _steps(prof: StepProfiler, n: int) -> None:
    x = torch.randn(256, 256, device="cuda")
    for step in range(1, n + 1):
        with prof.step(step):
            with phase("test/matmul"):
                (x @ x).sum().item()
    prof.close()


def test_torch_trace_holds_cuda_kernels(tmp_path):
    device = torch.device("cuda")
    prof = StepProfiler(ProfileConfig(enabled=True, step_start=2, step_end=3), tmp_path, rank=0, device=device)
    _steps(prof, 3)
    table = prof.written[1].read_text(encoding="utf-8")
    assert "self_cuda_time_total" in table and "test/matmul" in table
    assert "gemm" in table.lower() or "aten::mm" in table


def test_nsys_window_opens_and_closes(tmp_path):
    device = torch.device("cuda")
    cfg = ProfileConfig(enabled=True, tool="nsys", step_start=1, step_end=3)
    check_profile(cfg, world_size=1, cuda=True)
    prof = StepProfiler(cfg, tmp_path, rank=0, device=device)
    x = torch.randn(64, 64, device="cuda")
    with prof.step(1):
        assert prof._nvtx is not None  # the capture range is open
        with phase("test/nvtx"):
            (x @ x).sum().item()
    prof.close()
    assert prof._nvtx is None and prof.written == []
