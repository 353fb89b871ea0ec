"""Sketch-delta sync into a real SGLang engine on one GPU (skipped without CUDA or without sglang).

Runs :func:`tools.sglang_sync_smoke.check` on a tiny random Llama: three deltas through the
custom weight loader, every engine weight read back and compared bitwise with the CPU
reference apply, the engine's fingerprint compared with the reference's, greedy generation
after the deltas identical to greedy generation after a full refit of the reference weights,
and a replayed delta refused. In-process ``sglang.Engine`` always; the HTTP server (both
payload serializations) under ``slow``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "sglang_sync_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    pytest.importorskip("sglang")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("sglang_sync_smoke", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(smoke, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama") / "ckpt"
    state = smoke.build_checkpoint(path, smoke.TINY)
    return path, state, smoke.make_deltas(smoke.TINY, 3, rank=16)


def _assert_passed(res, state):
    assert res["passed"], res["failures"]
    assert res["weights_checked"] == len(state) and res["weights_moved"] > 0
    assert res["bytes_per_sync"] < 0.5 * res["full_refit_bytes"]


def test_sglang_engine_applies_deltas_bitwise(smoke, checkpoint):
    path, state, deltas = checkpoint
    driver = smoke.EngineDriver(str(path))
    try:
        res = smoke.check(driver, state, deltas)
    finally:
        driver.close()
    _assert_passed(res, state)
    assert res["fingerprint_checked"] and res["fingerprint_salt"] == deltas[-1].new_version  # the engine's version


@pytest.mark.slow
@pytest.mark.parametrize("serialization", ["pickle", "cuda_ipc"])
def test_sglang_http_server_applies_deltas_bitwise(smoke, checkpoint, serialization):
    path, state, deltas = checkpoint
    driver = smoke.ServerDriver(str(path), serialization=serialization)
    try:
        res = smoke.check(driver, state, deltas)
    finally:
        driver.close()
    _assert_passed(res, state)
    assert res["fingerprint_checked"] and res["fingerprint_salt"] == deltas[-1].new_version  # the engine's version


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an engine with TP 2 needs two GPUs")
def test_sglang_engine_at_tp2_fingerprints_across_ranks(smoke, checkpoint):
    """Sharded engine: every rank applies its share; the fingerprint is assembled over the engine's
    TP ranks and must equal the reference's; greedy tokens after the deltas equal a full refit's."""
    path, state, deltas = checkpoint
    driver = smoke.EngineDriver(str(path), {"tp_size": 2})
    try:
        res = smoke.check(driver, state, deltas, readback=lambda name: state[name].dim() == 1)
    finally:
        driver.close()
    assert res["passed"], res["failures"]
    assert res["fingerprint_checked"] and res["weights_checked"] > 0
    assert res["fingerprint_salt"] == deltas[-1].new_version  # the rows of the engine's version
