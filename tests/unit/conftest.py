"""Fixtures shared by the unit tests."""

from __future__ import annotations

import warnings

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on a shared 2-core machine: intra-op threads only add contention (≈10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def groups():
    """Single-process megatron-core parallel state (gloo world of 1), torn down after the module."""
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = initialize_parallel(ParallelConfig())
    yield g
    destroy_parallel()
