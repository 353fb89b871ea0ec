"""Fixtures shared by the unit tests.

The unit tier is one process: megatron-core's parallel state may be built on a gloo world of one
rank over an in-memory ``HashStore`` (what ``megatron_logra.parallel.init_distributed`` does outside
torchrun), nothing else. :func:`_one_process_worlds_only` enforces it for every unit test; groups
of several ranks belong in ``tests/distributed``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from support.unit_world import check_unit_world


@pytest.fixture(scope="session", autouse=True)
def _one_process_worlds_only():
    """Session-wide, so it is in place before any module-scoped fixture (``groups``) builds a world."""
    real = dist.init_process_group

    def guarded(*args, **kwargs):
        check_unit_world(kwargs)
        return real(*args, **kwargs)

    dist.init_process_group = guarded
    yield
    dist.init_process_group = real


def _with_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on a shared 2-core machine: intra-op threads only add contention (≈10x slower)."""
    yield from _with_threads(1)


@pytest.fixture(scope="module")
def two_threads():
    """Two intra-op threads for a module of whole RL runs (the machine's two cores), restored after it."""
    yield from _with_threads(2)


@pytest.fixture(scope="module")
def groups():
    """Single-process megatron-core parallel state (gloo world of 1), torn down after the module."""
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = initialize_parallel(ParallelConfig())
    yield g
    destroy_parallel()
