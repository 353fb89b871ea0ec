"""Policy sync to an SGLang engine with data-parallel replicas (``--dp-size 2``), on CPU.

SGLang's side is ``support.sglang_stand_ins.DataParallelRuntime``: two independent scheduler
replicas, every update sent to both, ``get_weights_by_name`` answered with one list per replica
as SGLang's tokenizer manager does at ``dp_size > 1``. The weights are real: every check compares
both replicas bitwise with the HF-layout reference apply, and drift is judged by the project's own
``fingerprint``/``drift``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.rollout.sglang_engine import SGLangEngine
from megatron_logra.sync import SyncError, encode
from megatron_logra.sync.fingerprint import drift, fingerprint
from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangError, SGLangServerTarget
from megatron_logra.sync.sglang_loader import FINGERPRINT_PARAM, STATE_PARAM, engine_version
from megatron_logra.sync.sglang_payloads import _replica_answers
from megatron_logra.sync.sglang_protocol import DP_MISMATCH_PREFIX
# servers: the fixture that closes the FakeServers a test starts
from support.sglang_stand_ins import (PADDED, VOCAB, DataParallelRuntime, FakeEngine, FakeSGLang, FakeServer,
                                     SchedulerRuntime, SGLangLlama, delta_chain, hf_state, reference, servers)

DP = 2
CORRUPT = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _assert_every_replica(runtime, hf, tp=1):
    """Every replica's every TP rank holds bitwise the weights SGLang would load from ``hf``."""
    for i, replica in enumerate(runtime.replicas):
        for r, model in enumerate(replica.models):
            want = dict(SGLangLlama(hf, tp=tp, rank=r, vocab_pad=8).named_parameters())
            got = {n: p for n, p in model.named_parameters() if n not in (STATE_PARAM, FINGERPRINT_PARAM)}
            assert set(got) == set(want), (i, r)
            for name in want:
                assert torch.equal(got[name], want[name]), (i, r, name)


def _dp_runtime(hf, tp=1, **kw):
    return DataParallelRuntime([SchedulerRuntime([SGLangLlama(hf, tp=tp, rank=r, vocab_pad=8) for r in range(tp)])
                                for _ in range(DP)], **kw)


def _target(transport, runtime, servers, tp=1):
    if transport == "engine":
        return SGLangEngineTarget(FakeEngine(runtime, tp_size=tp))
    server = FakeServer(runtime, tp_size=tp)
    servers.append(server)
    return SGLangServerTarget(server.url, timeout=10)


@pytest.mark.parametrize("transport,tp", [("engine", 1), ("http", 1), ("http", 2)])
def test_deltas_and_refits_reach_every_data_parallel_replica(transport, tp, servers):
    hf = hf_state()
    runtime = _dp_runtime(hf, tp)
    assert runtime.get_weights_by_name("model.norm.weight", 3) == [hf["model.norm.weight"][:3].float().tolist()] * DP
    target = _target(transport, runtime, servers, tp)
    engine = SGLangEngine(generate_fn=FakeSGLang(), target=target, vocab_size=VOCAB, padded_vocab_size=PADDED)
    assert engine.weight_version == 0 and engine.engine_vocab_size == VOCAB  # both read back from two replicas
    deltas = delta_chain(4)
    for d in deltas:
        assert engine.apply_sketch_delta(encode(d)) == d.new_version
    ref = reference(hf, deltas)
    _assert_every_replica(runtime, ref, tp)
    assert [engine_version(rep.models[0]) for rep in runtime.replicas] == [4] * DP
    fp = target.fingerprint()
    if tp == 1:
        assert drift(fingerprint(ref), fp) == []
    else:  # the stand-in's TP ranks have no group to exchange rows over: drift checks are off, not faked
        assert fp is None
        assert runtime.dead is None
        return  # the stand-in's load_weights is SGLang's at TP=1 only

    new = hf_state(seed=5)
    target.chunk_bytes = 4096
    engine.update_weights_full(new, 10)
    assert engine.weight_version == 10
    assert [engine_version(rep.models[0]) for rep in runtime.replicas] == [10] * DP
    _assert_every_replica(runtime, new)
    more = delta_chain(2, start=10)
    for d in more:
        assert engine.apply_sketch_delta(encode(d)) == d.new_version
    _assert_every_replica(runtime, reference(new, more))
    assert drift(fingerprint(reference(new, more)), target.fingerprint()) == []
    assert runtime.dead is None


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_a_corrupted_replica_fails_the_drift_check_until_a_full_refit(transport, servers):
    hf = hf_state()
    runtime = _dp_runtime(hf)
    target = _target(transport, runtime, servers)
    d1, d2 = delta_chain(2)
    target.apply_sketch_delta(d1)
    with torch.no_grad():  # one replica's weight goes wrong (every row, so every sampled row differs)
        dict(runtime.replicas[1].models[0].named_parameters())[CORRUPT][:, 0] += 1.0
    target.apply_sketch_delta(d2)  # fingerprints both replicas after applying
    ref = reference(hf, [d1, d2])
    trainer = fingerprint(ref)
    engine_fp = target.fingerprint()
    assert drift(trainer, engine_fp) == [CORRUPT]
    assert engine_fp[CORRUPT].startswith(DP_MISMATCH_PREFIX)
    assert f"replica 0={trainer[CORRUPT]}" in engine_fp[CORRUPT]  # the healthy replica's hash is the trainer's
    assert f"replica 1={trainer[CORRUPT]}" not in engine_fp[CORRUPT]

    target.update_weights_full(ref, 2)  # the drift check's fix: a dense refit of every replica
    _assert_every_replica(runtime, ref)
    assert drift(trainer, target.fingerprint()) == []


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_a_replica_that_missed_an_update_is_named_and_a_full_refit_brings_it_back(transport, servers, caplog):
    hf = hf_state()
    runtime = _dp_runtime(hf)
    target = _target(transport, runtime, servers)
    d1, d2, d3 = delta_chain(3)
    target.apply_sketch_delta(d1)
    lagging = runtime.replicas[1]
    real_update = lagging.update
    lagging.update = lambda rank, named_tensors, load_format: None  # drops the next request
    with pytest.raises(SGLangError, match=r"data-parallel replicas disagree.*version: replica 0=2, replica 1=1") \
            as info:
        target.apply_sketch_delta(d2)
    assert info.value.kind == "engine" and "nonce" in str(info.value)
    lagging.update = real_update
    assert [engine_version(rep.models[0]) for rep in runtime.replicas] == [2, 1]

    # a client that connects now reads the version as unknown (-1) and must not send deltas ...
    fresh = _target(transport, runtime, servers)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.sync.sglang_protocol"):
        assert fresh.weight_version == -1
    assert "replicas disagree" in caplog.text
    with pytest.raises(SyncError, match="replica 0=2, replica 1=1"):
        fresh.apply_sketch_delta(d3)
    assert [engine_version(rep.models[0]) for rep in runtime.replicas] == [2, 1]  # nothing was sent

    # ... and the full refit (the caller's failure path) brings both replicas to one version and weights
    ref = reference(hf, [d1, d2])
    for t in (target, fresh):
        t.update_weights_full(ref, 2)
        assert t.weight_version == 2
        _assert_every_replica(runtime, ref)
    assert target.apply_sketch_delta(d3) == 3
    _assert_every_replica(runtime, reference(hf, [d1, d2, d3]))
    assert drift(fingerprint(reference(hf, [d1, d2, d3])), target.fingerprint()) == []


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_plain_data_parallelism_is_refused_before_anything_is_sent(transport, servers):
    """Without --enable-dp-attention SGLang asserts dp_size == 1 in update_weights_from_tensor: the
    client says so up front instead of failing on the first update."""
    runtime = _dp_runtime(hf_state(), enable_dp_attention=False)
    target = _target(transport, runtime, servers)
    with pytest.raises(SGLangError, match="dp_size=2.*--enable-dp-attention") as info:
        target.apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "config"
    if transport == "engine":
        assert [c for c in target.engine.calls if c[0] == "update"] == []
    else:
        assert "/update_weights_from_tensor" not in servers[-1].paths()
    assert [engine_version(rep.models[0]) for rep in runtime.replicas] == [0, 0]


def test_answers_per_replica_are_counted_against_dp_size():
    one = [1.0, 2.0]
    assert _replica_answers(one, 1, "x") == [one]
    assert _replica_answers(one, None, "x") == [one]
    assert _replica_answers([one, None], 2, "x") == [one, None]
    assert _replica_answers([None, None], 2, "x") is None and _replica_answers(None, 2, "x") is None
    with pytest.raises(SGLangError, match="dp_size=3 .* answered for 2"):
        _replica_answers([one, one], 3, "x")
    with pytest.raises(SGLangError, match="dp_size=2 .* answered for one"):
        _replica_answers(one, 2, "x")
