"""The served model's weight dtype, as the sync loader reports it, against the trainer's ``model.params_dtype``.

A server keeps the dtype it was started with (``--dtype``); refits and sketch deltas reach it cast to that
dtype, while the drift check compares its weights with the trainer's in the trainer's dtype. The stand-ins of
``support.sglang_stand_ins`` run the real sync loader on SGLang-shaped models (bf16 weights, as
``sglang.Engine`` loads a bf16 checkpoint) behind ``SGLangEngineTarget`` / ``SGLangServerTarget``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.rollout.sglang_checks import engine_dtype_mismatch
from megatron_logra.rollout.sglang_engine import SGLangEngine
from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangServerTarget
from megatron_logra.sync.sglang_weights import engine_dtype
from support.sglang_stand_ins import V, FakeEngine, FakeServer, SchedulerRuntime, SGLangLlama, hf_state


@pytest.fixture
def servers():
    """The ``FakeServer``s a test starts, closed after it."""
    made: list = []
    yield made
    for server in made:
        server.close()


def _target(transport, runtime, servers):
    if transport == "engine":
        return SGLangEngineTarget(FakeEngine(runtime))
    server = FakeServer(runtime)
    servers.append(server)
    return SGLangServerTarget(server.url, timeout=10)


def test_engine_dtype_is_the_dtype_of_the_weights():
    model = SGLangLlama(hf_state())
    assert engine_dtype(model) == "bfloat16"
    assert engine_dtype(SGLangLlama({k: v.float() for k, v in hf_state().items()})) == "float32"
    assert engine_dtype(torch.nn.Module()) is None


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_a_trainer_in_another_dtype_is_warned_about_at_start(transport, servers, caplog):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    target = _target(transport, runtime, servers)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rollout.sglang_engine"):
        built = SGLangEngine(generate_fn=lambda payload: None, target=target, vocab_size=V, padded_vocab_size=V,
                             trainer_dtype="float32")
    assert built.engine_dtype == "bfloat16" and target.weight_dtype == "bfloat16"
    warned = [r.getMessage() for r in caplog.records if "holds its weights in bfloat16" in r.getMessage()]
    assert len(warned) == 1 and "model.params_dtype=float32" in warned[0] and "model.params_dtype=bfloat16" in warned[0]
    assert "--dtype" not in warned[0]  # SGLang's kernels have no float32 path: not a fix to suggest


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_an_engine_in_the_trainers_dtype_is_not_warned_about(transport, servers, caplog):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    target = _target(transport, runtime, servers)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rollout.sglang_engine"):
        built = SGLangEngine(generate_fn=lambda payload: None, target=target, vocab_size=V, padded_vocab_size=V,
                             trainer_dtype="bfloat16")
    assert built.engine_dtype == "bfloat16"
    assert not [r for r in caplog.records if "holds its weights" in r.getMessage()]


def test_dtype_mismatch_needs_both_dtypes():
    assert engine_dtype_mismatch(None, "float32") is None  # a loader that does not report it
    assert engine_dtype_mismatch("bfloat16", None) is None
    assert engine_dtype_mismatch("bfloat16", "bfloat16") is None
    assert "--dtype bfloat16" in engine_dtype_mismatch("float16", "bfloat16")
