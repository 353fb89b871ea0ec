"""The CPU tiers hide CUDA on a GPU host unless the run selects the GPU tier (tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _conftest():
    spec = importlib.util.spec_from_file_location("tests_root_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("markexpr, args, gpu", [
    ("", [str(TESTS)], False),
    ("", [str(TESTS / "unit")], False),
    ("", [str(TESTS / "gpu")], True),
    ("", [str(TESTS / "gpu" / "test_train_gpu.py") + "::test_rl_job_runs_on_gpu"], True),
    ("", [str(TESTS / "gpu"), str(TESTS / "unit" / "test_config.py")], False),
    ("gpu", [str(TESTS)], True),
    ("not gpu", [str(TESTS)], False),
    ("gpu and not slow", [str(TESTS)], True),
])
def test_which_runs_keep_cuda_visible(markexpr, args, gpu):
    config = SimpleNamespace(option=SimpleNamespace(markexpr=markexpr), args=args)
    assert _conftest()._selects_gpu_tier(config) is gpu


def test_this_cpu_tier_run_hides_cuda():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""


def test_unit_tier_starts_no_process_group():
    """``tests/unit`` runs without a process group; spawned gloo groups belong in ``tests/distributed``
    (``support.gloo.spawn_group`` tears them down safely)."""
    starters = ("init_process_group", "mp.spawn", "multiprocessing.spawn", "torch.distributed.run")
    offenders = [f"{path.name}: {word}" for path in sorted((TESTS / "unit").glob("*.py"))
                 for word in starters if word in path.read_text() and path.name != Path(__file__).name]
    assert offenders == []
