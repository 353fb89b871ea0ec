"""The GPU smoke tools' checks that need no GPU: ``tools/gpu_smoke.py --hidden`` must give whole heads
of dimension 128, and ``tools/sglang_rollout_smoke.py`` reports rollouts without a single token as a
failure with a message instead of crashing on ``max()`` of nothing."""

from __future__ import annotations

import math
import statistics
from types import ModuleType

import pytest

from tool_modules import load_tool


@pytest.fixture(scope="module")
def gpu_smoke() -> ModuleType:
    return load_tool("gpu_smoke")


@pytest.fixture(scope="module")
def rollout_smoke() -> ModuleType:
    return load_tool("sglang_rollout_smoke")


@pytest.mark.parametrize("hidden", ["64", "127", "200"])
def test_gpu_smoke_refuses_a_hidden_size_without_whole_heads(gpu_smoke, hidden, capsys):
    """``--hidden 64`` gave ``hidden // 128 = 0`` heads: a ModelConfig traceback on the GPU node (here the
    check comes before the CUDA probe, so it runs on any machine)."""
    with pytest.raises(SystemExit) as exc:
        gpu_smoke.main(["--hidden", hidden])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --hidden: {hidden} is not a multiple of 128" in err and "Traceback" not in err


def test_gpu_smoke_accepts_multiples_of_128(gpu_smoke, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA this would start the smoke run")
    assert gpu_smoke.main(["--hidden", "256"]) == 0
    assert "no CUDA device" in capsys.readouterr().err


def test_rollout_smoke_without_tokens_is_a_failure_with_a_message(rollout_smoke):
    mean, top, line, failure = rollout_smoke.logprob_gap_check([], 0.05)
    assert math.isnan(mean) and top is None
    assert "no rollout produced a token" in line
    assert failure is not None and "no completion token" in failure


def test_rollout_smoke_gap_check_on_tokens(rollout_smoke):
    gaps = [0.01, 0.03, 0.02]
    mean, top, line, failure = rollout_smoke.logprob_gap_check(gaps, 0.05)
    assert mean == pytest.approx(statistics.mean(gaps)) and top == 0.03 and failure is None
    assert line == "rollout vs trainer log-probs over 3 tokens: mean |gap| 0.0200, max 0.0300"
    _, _, _, failure = rollout_smoke.logprob_gap_check(gaps, 0.01)
    assert failure == "mean |rollout - trainer log-prob| 0.0200 > 0.01"
    _, _, _, failure = rollout_smoke.logprob_gap_check([float("nan")], 0.05)
    assert failure is not None  # a NaN log-prob never passes
