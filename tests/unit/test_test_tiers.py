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


def test_unit_tier_starts_no_multi_process_group():
    """``tests/unit`` is one process: megatron's parallel state on a one-rank world over an in-memory
    store at most (``conftest._one_process_worlds_only`` refuses anything else at run time); spawned
    gloo groups belong in ``tests/distributed`` (``support.gloo.spawn_group`` tears them down safely)."""
    starters = ("mp.spawn", "multiprocessing.spawn", "torch.distributed.run", "init_method=")
    offenders = [f"{path.name}: {word}" for path in sorted((TESTS / "unit").glob("*.py"))
                 for word in starters if word in path.read_text() and path.name != Path(__file__).name]
    assert offenders == []


def test_the_unit_tier_guard_refuses_a_real_multi_rank_world():
    import torch.distributed as dist
    from support.unit_world import check_unit_world

    check_unit_world({"store": dist.HashStore(), "world_size": 1})
    for kwargs in ({"store": dist.HashStore(), "world_size": 2}, {"world_size": 1}, {}):
        with pytest.raises(RuntimeError, match="tests/distributed"):
            check_unit_world(kwargs)
    with pytest.raises(RuntimeError, match="one-rank world"):  # the installed guard, not just the check
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=2)
    assert not dist.is_initialized()
