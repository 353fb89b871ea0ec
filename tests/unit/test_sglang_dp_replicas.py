"""Policy sync to an SGLang engine with data parallelism (``--tp 2 --dp-size 2``), on CPU.

SGLang updates weights at ``dp_size > 1`` only with ``--enable-dp-attention``, and then the engine is one
model over its TP ranks: attention split over ``tp / dp`` ranks, ``embed_tokens`` unsharded, the MLP and
``lm_head`` over all ``tp``. SGLang's side is ``support.sglang_stand_ins.DataParallelRuntime`` over
``SGLangLlama(..., dp_attention=2)`` models in that layout, answering ``get_weights_by_name`` with one
list per data-parallel rank as SGLang's tokenizer manager does. The client refuses sketch deltas there
before sending anything (the loader's one-TP-position layout cannot apply them), turns fingerprints off,
and takes dense refits, whose loader records it reads back from every data-parallel rank. The weights
are real: refits are compared bitwise with what SGLang would load.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.rollout.sglang_engine import SGLangEngine
from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangError, SGLangServerTarget
from megatron_logra.sync.sglang_loader import (FINGERPRINT_PARAM, STATE_PARAM, command_as_named_tensors,
                                               delta_as_named_tensors, engine_version, read_state, sync_loader)
from megatron_logra.sync.sglang_payloads import _replica_answers
from megatron_logra.sync import encode
# servers: the fixture that closes the FakeServers a test starts
from support.sglang_stand_ins import (PADDED, VOCAB, DataParallelRuntime, FakeEngine, FakeSGLang, FakeServer,
                                     SGLangLlama, delta_chain, hf_state, servers)

TP, DP = 2, 2


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _models(hf, dp=DP):
    return [SGLangLlama(hf, tp=TP, rank=r, vocab_pad=8, dp_attention=dp) for r in range(TP)]


def _assert_every_rank(runtime, hf):
    """Every TP rank holds bitwise the weights SGLang would load from ``hf`` in the dp-attention layout."""
    for r, model in enumerate(runtime.models):
        want = dict(_models(hf)[r].named_parameters())
        got = {n: p for n, p in model.named_parameters() if n not in (STATE_PARAM, FINGERPRINT_PARAM)}
        assert set(got) == set(want), r
        for name in want:
            assert torch.equal(got[name], want[name]), (r, name)


def _target(transport, runtime, servers):
    if transport == "engine":
        return SGLangEngineTarget(FakeEngine(runtime, tp_size=TP))
    server = FakeServer(runtime, tp_size=TP)
    servers.append(server)
    return SGLangServerTarget(server.url, timeout=10)


def _updates(target, servers):
    """The weight updates ``target`` sent (the engine's calls, or its server's requests)."""
    if isinstance(target, SGLangEngineTarget):
        return [c for c in target.engine.calls if c[0] == "update"]
    return [p for p in servers[-1].paths() if p == "/update_weights_from_tensor"]


def test_the_stand_in_has_sglangs_dp_attention_layout_which_no_delta_fits():
    """Why deltas are refused: attention at tp/dp = 1 rank, the MLP over both, so the loader's one TP
    position misreads half the model and rejects the delta (never raising)."""
    hf = hf_state()
    m0, m1 = _models(hf)
    qkv = m0.model.layers[0].self_attn.qkv_proj
    gate_up = m0.model.layers[0].mlp.gate_up_proj
    assert (qkv.tp_size, qkv.weight.shape[0]) == (1, hf["model.layers.0.self_attn.q_proj.weight"].shape[0] * 2)
    assert (gate_up.tp_size, gate_up.weight.shape[0]) == (2, hf["model.layers.0.mlp.gate_proj.weight"].shape[0])
    assert m0.model.embed_tokens.weight.shape[0] == VOCAB + 8 and m0.lm_head.weight.shape[0] == VOCAB // 2 + 8
    assert torch.equal(m0.model.layers[0].self_attn.qkv_proj.weight, m1.model.layers[0].self_attn.qkv_proj.weight)
    before = {n: p.clone() for n, p in m0.named_parameters()}
    sync_loader(m0, delta_as_named_tensors(encode(delta_chain(1)[0]))
                + command_as_named_tensors({"op": "apply", "nonce": "x"}))
    state = read_state(m0)
    assert not state["ok"] and state["version"] == 0
    assert all(torch.equal(p, before[n]) for n, p in m0.named_parameters() if n in before)


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_deltas_are_refused_up_front_and_dense_refits_reach_every_data_parallel_rank(transport, servers):
    hf = hf_state()
    runtime = DataParallelRuntime(_models(hf), DP)
    assert runtime.get_weights_by_name("model.norm.weight", 3) == [hf["model.norm.weight"][:3].float().tolist()] * DP
    target = _target(transport, runtime, servers)
    with pytest.raises(SGLangError, match=r"dp_size=2 with data-parallel attention.*--dp-size 1.*sync\.mode=full") \
            as info:
        target.apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "config" and _updates(target, servers) == []
    if transport == "http":
        assert servers[-1].paths() == ["/server_info"]
    with pytest.raises(SGLangError, match="dp_size=2") as info:  # every rank refuses when the engine is built
        SGLangEngine(generate_fn=FakeSGLang(), target=target, vocab_size=VOCAB, padded_vocab_size=PADDED)
    assert info.value.kind == "config"

    engine = SGLangEngine(generate_fn=FakeSGLang(), target=target, vocab_size=VOCAB, padded_vocab_size=PADDED,
                          deltas=False)  # sync.mode=full
    assert engine.weight_version == 0 and engine.engine_vocab_size == VOCAB  # read back from both DP ranks
    new = hf_state(seed=5)
    target.chunk_bytes = 4096
    engine.update_weights_full(new, 10)
    assert engine.weight_version == 10
    assert [engine_version(m) for m in runtime.models] == [10] * TP
    _assert_every_rank(runtime, new)
    assert target.fingerprint() is None  # the loader cannot read this layout in HF order: drift checks are off
    assert _updates(target, servers) and runtime.dead is None


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_a_data_parallel_rank_that_missed_a_refit_is_named_and_the_next_refit_brings_it_back(transport, servers,
                                                                                                caplog):
    hf = hf_state()
    runtime = DataParallelRuntime(_models(hf), DP)
    target = _target(transport, runtime, servers)
    assert target.weight_version == 0 and target.vocab_size == VOCAB  # both ranks have a loader record
    real_update = runtime.update
    runtime.update = lambda rank, named, load_format: None if rank == 1 else real_update(rank, named, load_format)
    new = hf_state(seed=5)
    with pytest.raises(SGLangError, match=r"data-parallel replicas disagree.*version: replica 0=-1, replica 1=0") \
            as info:
        target.update_weights_full(new, 3)  # data-parallel rank 1 (TP rank 1) drops every request
    assert info.value.kind == "engine" and "nonce" in str(info.value)
    runtime.update = real_update
    assert [engine_version(m) for m in runtime.models] == [-1, 0]

    # a client that connects now reads the version as unknown (-1) ...
    fresh = _target(transport, runtime, servers)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.sync.sglang_state"):
        assert fresh.weight_version == -1
    assert "replicas disagree" in caplog.text
    # ... and a full refit brings every rank to one version and the same weights
    for t in (target, fresh):
        t.update_weights_full(new, 3)
        assert t.weight_version == 3
        _assert_every_rank(runtime, new)
    assert [engine_version(m) for m in runtime.models] == [3] * TP


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_plain_data_parallelism_is_refused_before_anything_is_sent(transport, servers):
    """Without --enable-dp-attention SGLang asserts dp_size == 1 in update_weights_from_tensor: the
    client says so up front, for refits too, instead of failing on the first update."""
    hf = hf_state()
    runtime = DataParallelRuntime([SGLangLlama(hf)], DP, enable_dp_attention=False)
    target = SGLangEngineTarget(FakeEngine(runtime)) if transport == "engine" else None
    if target is None:
        servers.append(FakeServer(runtime))
        target = SGLangServerTarget(servers[-1].url, timeout=10)
    with pytest.raises(SGLangError, match="dp_size=2.*--enable-dp-attention") as info:
        target.apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "config"
    with pytest.raises(SGLangError, match="dp_size=2.*--enable-dp-attention"):
        target.update_weights_full(hf, 1)
    if transport == "engine":
        assert target.engine.calls == []
    else:
        assert "/update_weights_from_tensor" not in servers[-1].paths()
    assert engine_version(runtime.models[0]) == 0


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
