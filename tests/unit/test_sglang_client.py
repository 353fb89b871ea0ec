"""SGLang side of policy sync on CPU: the never-raising loader, payloads, and both clients' protocol.

No SGLang here (it cannot start on this CPU), so its side is played by the stand-ins of
``support.sglang_stand_ins`` (model layouts, the scheduler, the engine's pickling), and its
``FakeServer`` answers SGLang's HTTP routes with SGLang's status codes and bodies and unpickles
with an allow-list like SGLang's ``SafeUnpickler``. The weights themselves are real: every
check compares them bitwise with the HF-layout reference apply.
"""

from __future__ import annotations

import base64
import io
import socket

import pytest
import torch

from megatron_logra.sync import SyncError, encode
from megatron_logra.sync.fingerprint import drift, fingerprint, fingerprint_salt, sampled_rows_of
from megatron_logra.sync.sglang_client import (
    SGLangEngineTarget,
    SGLangError,
    SGLangServerTarget,
    chunk_named_tensors,
    serialize_named_tensors,
)
from megatron_logra.sync import sglang_loader
from megatron_logra.sync.sglang_loader import (
    COMMAND_NAME,
    FINGERPRINT_PARAM,
    LOADER_PATH,
    STATE_PARAM,
    TENSOR_NAME,
    command_as_named_tensors,
    delta_as_named_tensors,
    engine_hf_view,
    engine_version,
    read_state,
    sync_loader,
)
from megatron_logra.sync.synthetic import DenseShape, random_delta
# servers: the fixture that closes the FakeServers a test starts
from support.sglang_stand_ins import (F, G, H, HID, SHAPE, V, FakeEngine, FakeServer, SafeUnpickler,
                                     SchedulerRuntime, SGLangLlama, SGLangQwen2, delta_chain, hf_state, reference,
                                     servers)

RANK = 8


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _engine_params(model):
    return {n: p for n, p in model.named_parameters() if n not in (STATE_PARAM, FINGERPRINT_PARAM)}


def _assert_same(model, expect):
    got, want = _engine_params(model), _engine_params(expect)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


# --------------------------------------------------------------------------- the loader


def test_pickled_payload_round_trips_through_sglangs_unpickler_into_the_loader():
    """Delta + command tensors -> client serialization -> SGLang-style unpickling -> loader: bitwise the HF apply."""
    hf = hf_state()
    deltas = delta_chain(3)
    model = SGLangLlama(hf)
    for d in deltas:
        entry = serialize_named_tensors(delta_as_named_tensors(d) + command_as_named_tensors({"nonce": "n"}))
        named = SafeUnpickler(io.BytesIO(base64.b64decode(entry))).load()
        assert [n for n, _ in named] == [TENSOR_NAME, COMMAND_NAME]
        assert named[0][1].dtype == torch.uint8 and bytes(named[0][1].numpy()) == encode(d)
        sync_loader(model, named)
        state = read_state(model)
        assert state["ok"] and state["nonce"] == "n" and state["op"] == "apply" and state["version"] == d.new_version
    _assert_same(model, SGLangLlama(reference(hf, deltas)))
    assert engine_version(model) == 3 and read_state(model)["seq"] == 3


def test_loader_records_rejections_without_raising_or_touching_weights():
    hf = hf_state()
    model = SGLangLlama(hf)
    before = {n: p.detach().clone() for n, p in _engine_params(model).items()}
    good = delta_chain(1)[0]
    corrupt = bytearray(encode(good))
    corrupt[len(corrupt) // 2] ^= 1
    cases = [
        ([(TENSOR_NAME, torch.frombuffer(corrupt, dtype=torch.uint8))], None),  # checksum / truncated
        (delta_as_named_tensors(delta_chain(1, start=1)[0]), "gap"),
        ([("model.norm.weight", torch.zeros(HID))], "keys"),
        (command_as_named_tensors({"op": "explode"}), "keys"),
        (command_as_named_tensors({"op": "set_version", "version": -3}), "keys"),
        (command_as_named_tensors({"op": "set_version", "version": True}), "keys"),
    ]
    for seq, (named, kind) in enumerate(cases, start=1):
        sync_loader(model, named)  # never raises
        state = read_state(model)
        assert state["seq"] == seq and not state["ok"] and state["error"] and state["version"] == 0
        if kind:
            assert state["error_kind"] == kind
    assert engine_version(model) == 0
    assert all(torch.equal(p, before[n]) for n, p in _engine_params(model).items())
    sync_loader(model, delta_as_named_tensors(good))
    assert read_state(model)["ok"] and engine_version(model) == 1


def test_tp_disagreement_after_commit_marks_the_version_unknown_until_a_refit(monkeypatch):
    model = SGLangLlama(hf_state(), tp=2, rank=0)
    votes = iter([True, False])  # validation agreed, another rank failed its commit
    monkeypatch.setattr(sglang_loader, "_tp_all", lambda ok: ok and next(votes))
    sync_loader(model, delta_as_named_tensors(delta_chain(1)[0]))
    state = read_state(model)
    assert not state["ok"] and state["error_kind"] == "apply" and state["version"] == -1
    monkeypatch.setattr(sglang_loader, "_tp_all", lambda ok: ok)
    sync_loader(model, delta_as_named_tensors(delta_chain(1, start=1)[0]))
    assert read_state(model)["error_kind"] == "gap"  # refused until a full refit sets the version
    sync_loader(model, command_as_named_tensors({"op": "set_version", "version": 1}))
    assert read_state(model)["ok"] and engine_version(model) == 1


def test_tp_rejection_on_another_rank_leaves_this_rank_untouched(monkeypatch):
    model = SGLangLlama(hf_state(), tp=2, rank=1)
    before = {n: p.detach().clone() for n, p in _engine_params(model).items()}
    monkeypatch.setattr(sglang_loader, "_tp_all", lambda ok: False)
    sync_loader(model, delta_as_named_tensors(delta_chain(1)[0]))
    state = read_state(model)
    assert not state["ok"] and "another TP rank" in state["error"] and state["version"] == 0
    assert all(torch.equal(p, before[n]) for n, p in _engine_params(model).items())


def test_engine_fingerprint_in_hf_layout_equals_the_trainers_despite_vocab_padding():
    hf = hf_state()
    deltas = delta_chain(2)
    model = SGLangLlama(hf, vocab_pad=24)
    for d in deltas:
        sync_loader(model, delta_as_named_tensors(d))
    view = engine_hf_view(model)
    ref = reference(hf, deltas)
    assert set(view) == set(ref)
    assert all(torch.equal(view[k], ref[k]) for k in ref)
    sync_loader(model, command_as_named_tensors({"op": "fingerprint", "nonce": 7}))
    state = read_state(model)
    assert state["ok"] and state["fingerprint_version"] == 2 and state["fingerprint_error"] is None
    record = read_state(model, FINGERPRINT_PARAM)
    assert record["version"] == 2 and fingerprint_salt(record["fingerprint"]) == 2  # the rows of version 2
    assert drift(record["fingerprint"], fingerprint(ref, salt=2)) == []


def test_each_version_fingerprints_its_own_rows_so_a_later_check_catches_a_row_an_earlier_one_missed():
    """The loader salts its row sample with the engine's weight version; the comparing side reads the salt
    back (``fingerprint_salt``, as policy sync does) and samples the same rows. A drifted row that one
    version's sample misses is in another's."""
    hf = hf_state()
    name = "model.layers.1.mlp.down_proj.weight"  # [HID, F]: SGLang's rows are the HF rows at TP 1
    first = set(sampled_rows_of(name, hf[name].shape, salt=1))
    later, row = next((v, r) for v in range(2, 200)
                      for r in sampled_rows_of(name, hf[name].shape, salt=v) if r not in first)
    runtime = SchedulerRuntime([SGLangLlama(hf)])
    target = SGLangEngineTarget(FakeEngine(runtime))
    with torch.no_grad():  # the engine drifts in one row
        runtime.models[0].model.layers[1].mlp.down_proj.weight.view(torch.int16)[row, 3] ^= 1
    seen = {}
    for version in (1, later):
        target.reset_version(version)
        fp = target.fingerprint()
        assert fingerprint_salt(fp) == version and all(d.endswith(f"@{version}") for d in fp.values())
        seen[version] = drift(fp, fingerprint(hf, salt=fingerprint_salt(fp)))
    assert seen == {1: [], later: [name]}
    assert runtime.dead is None


def test_fingerprint_on_a_tp2_engine_is_reported_unavailable_not_raised():
    model = SGLangLlama(hf_state(), tp=2, rank=0)
    sync_loader(model, command_as_named_tensors({"op": "fingerprint"}))
    state = read_state(model)
    assert state["ok"] and state["fingerprint_version"] is None and "TP=2" in state["fingerprint_error"]


def test_chunking_bounds_bytes_and_keeps_every_tensor_once():
    state = {f"t{i}": torch.zeros(10 * (i + 1), dtype=torch.bfloat16) for i in range(6)}
    chunks = list(chunk_named_tensors(state, max_bytes=64))
    assert [n for c in chunks for n, _ in c] == sorted(state)
    assert all(sum(t.numel() * 2 for _, t in c) <= 64 or len(c) == 1 for c in chunks)


# --------------------------------------------------------------------------- in-process engine client


@pytest.mark.parametrize("model_class", [SGLangLlama, SGLangQwen2], ids=["llama", "no-get_weights_by_name"])
def test_engine_target_applies_deltas_refits_and_fingerprints(model_class):
    hf = hf_state()
    runtime = SchedulerRuntime([model_class(hf, vocab_pad=8)])
    if model_class is SGLangQwen2:  # before the loader first runs, SGLang can read nothing from this class
        assert runtime.get_weights_by_name(STATE_PARAM, 1 << 20) is None
    engine = FakeEngine(runtime)
    target = SGLangEngineTarget(engine)
    assert target.weight_version == 0
    deltas = delta_chain(3)
    for d in deltas:
        assert target.apply_sketch_delta(encode(d)) == d.new_version
    ref = reference(hf, deltas)
    _assert_same(runtime.models[0], SGLangLlama(ref, vocab_pad=8))
    fp = target.fingerprint()
    assert fingerprint_salt(fp) == 3 and drift(fp, fingerprint(ref, salt=3)) == []  # the engine's version
    assert target.num_deltas == 3 and target.bytes_sent == sum(len(encode(d)) for d in deltas)
    updates = [c for c in engine.calls if c[0] == "update"]
    assert all(c[1] == LOADER_PATH for c in updates)
    assert [c[3] for c in updates if TENSOR_NAME in c[3]] == [[TENSOR_NAME, COMMAND_NAME]] * 3
    assert all(c[2] for c in updates if TENSOR_NAME in c[3])  # flush_cache after every delta

    # anchor refit through SGLang's default loader, then the version is what the trainer says
    new = hf_state(seed=5)
    target.chunk_bytes = 4096
    target.update_weights_full(new, 10)
    assert target.weight_version == 10 and engine_version(runtime.models[0]) == 10
    _assert_same(runtime.models[0], SGLangLlama(new, vocab_pad=8))
    assert sum(1 for c in engine.calls if c[0] == "update" and c[1] is None) > 1  # chunked
    fp = target.fingerprint()
    assert fingerprint_salt(fp) == 10 and drift(fp, fingerprint(new, salt=10)) == []
    assert runtime.dead is None
    if model_class is SGLangQwen2:  # the loader's reader serves its two records, not the model's weights
        assert runtime.get_weights_by_name("model.norm.weight", 10) is None


def test_a_refit_that_fails_part_way_leaves_the_version_unknown_until_a_refit_succeeds(monkeypatch):
    hf = hf_state()
    runtime = SchedulerRuntime([SGLangLlama(hf, vocab_pad=8)])
    engine = FakeEngine(runtime)
    target = SGLangEngineTarget(engine)
    d1, d2 = delta_chain(2)
    target.apply_sketch_delta(d1)
    target.chunk_bytes = 4096
    real_update = target._update
    dense_calls = []

    def flaky(named_tensors, load_format, flush_cache):
        if load_format is None:
            dense_calls.append(1)
            if len(dense_calls) == 2:
                return False, "connection reset by peer"
        return real_update(named_tensors, load_format, flush_cache)

    monkeypatch.setattr(target, "_update", flaky)
    with pytest.raises(SGLangError, match="full refit to version 7 failed"):
        target.update_weights_full(hf_state(seed=5), 7)
    assert engine_version(runtime.models[0]) == -1 and target.weight_version == -1
    with pytest.raises(SyncError, match="not sent to SGLang"):
        target.apply_sketch_delta(d2)  # its base (1) is not the engine's version: half-loaded weights
    monkeypatch.setattr(target, "_update", real_update)
    new = hf_state(seed=6)
    target.update_weights_full(new, 8)
    assert target.weight_version == 8 and engine_version(runtime.models[0]) == 8
    _assert_same(runtime.models[0], SGLangLlama(new, vocab_pad=8))
    assert runtime.dead is None


def test_engine_target_rejections_keep_the_version_and_never_kill_the_engine():
    hf = hf_state()
    runtime = SchedulerRuntime([SGLangLlama(hf)])
    engine = FakeEngine(runtime)
    target = SGLangEngineTarget(engine)
    d1, d2 = delta_chain(2)
    target.apply_sketch_delta(d1)
    n_updates = sum(1 for c in engine.calls if c[0] == "update")

    with pytest.raises(SyncError, match="not sent to SGLang.*already applied"):
        target.apply_sketch_delta(d1)  # replay: caught before anything is sent
    bad = bytearray(encode(d2))
    bad[-3] ^= 1
    with pytest.raises(SyncError):
        target.apply_sketch_delta(bytes(bad))  # corrupt: caught by decode on the trainer side
    assert sum(1 for c in engine.calls if c[0] == "update") == n_updates

    # the engine itself refuses (a weight it does not have): reason surfaces, version kept
    odd = random_delta(DenseShape(hidden=HID, layers=3, heads=H, kv_heads=G, ffn=F, vocab=V), RANK,
                       base_version=1, new_version=2, layers=[2])
    with pytest.raises(SyncError, match="rejected delta 1->2.*no parameters") as info:
        target.apply_sketch_delta(odd)
    assert info.value.kind == "name" and target.weight_version == 1 and runtime.dead is None
    assert target.apply_sketch_delta(d2) == 2


def test_engine_target_refuses_a_server_without_the_loader_before_sending():
    runtime = SchedulerRuntime([SGLangLlama(hf_state())], loaders=())
    engine = FakeEngine(runtime)
    with pytest.raises(SGLangError, match=f"--custom-weight-loader {LOADER_PATH}") as info:
        SGLangEngineTarget(engine).apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "config" and engine.calls == [] and runtime.dead is None
    engine.server_args.custom_weight_loader = None  # SGLang's default when the flag is not given
    with pytest.raises(SGLangError, match="does not register"):
        SGLangEngineTarget(engine).weight_version
    assert engine.calls == []


def test_engine_target_version_mismatch_with_the_engine_is_an_error():
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    target = SGLangEngineTarget(FakeEngine(runtime))
    target.reset_version(4)  # e.g. another trainer process refit it
    with pytest.raises(SyncError, match="engine at version 4") as info:
        target.apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "replay" and target.weight_version == 4  # the engine is ahead of this delta


def test_a_model_without_get_weights_by_name_is_a_clear_error():
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    engine = FakeEngine(runtime)
    engine.get_weights_by_name = lambda name, truncate_size=100: None
    with pytest.raises(SGLangError, match="get_weights_by_name"):
        SGLangEngineTarget(engine).weight_version


# --------------------------------------------------------------------------- HTTP client


def test_http_target_speaks_sglangs_protocol(servers):
    hf = hf_state()
    runtime = SchedulerRuntime([SGLangLlama(hf, tp=2, rank=r) for r in range(2)])
    server = FakeServer(runtime, tp_size=2, api_key="sekret", info_paths=("/get_server_info",))
    servers.append(server)
    target = SGLangServerTarget(server.url + "/", api_key="sekret", timeout=10)
    deltas = delta_chain(2)
    for d in deltas:
        assert target.apply_sketch_delta(d) == d.new_version
    ref = reference(hf, deltas)
    for r in range(2):
        _assert_same(runtime.models[r], SGLangLlama(ref, tp=2, rank=r))
    assert server.weight_version == "2"

    assert all(r["headers"].get("authorization") == "Bearer sekret" for r in server.requests)
    posts = [r for r in server.requests if r["method"] == "POST"]
    assert all(r["headers"]["content-type"] == "application/json" for r in posts)
    assert server.paths()[:2] == ["/server_info", "/get_server_info"]  # an older server: the newer path is 404
    assert server.paths().count("/server_info") == 1  # the path that answered is kept
    # one sync: read state, pause, send, read state back, continue, publish the version
    tail = server.paths()[-6:]
    assert tail == ["/get_weights_by_name", "/pause_generation", "/update_weights_from_tensor",
                    "/get_weights_by_name", "/continue_generation", "/update_weight_version"]
    upd = [r["body"] for r in server.requests if r["path"] == "/update_weights_from_tensor"][-1]
    assert upd["load_format"] == LOADER_PATH and upd["flush_cache"] is True
    assert len(upd["serialized_named_tensors"]) == 2
    reads = [r["body"] for r in server.requests if r["path"] == "/get_weights_by_name"]
    assert all(b["name"] == STATE_PARAM and b["truncate_size"] >= 1 << 20 for b in reads)
    # TP=2: the engine cannot fingerprint, so drift checks are skipped (None), not faked
    assert target.fingerprint() is None


def test_http_errors_are_mapped(servers):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    server = FakeServer(runtime, api_key="right")
    servers.append(server)
    with pytest.raises(SGLangError, match="401 unauthorized.*api_key") as info:
        SGLangServerTarget(server.url, api_key="wrong", timeout=10).weight_version
    assert info.value.kind == "auth" and info.value.status == 401

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(SGLangError, match="unreachable") as info:
        SGLangServerTarget(f"http://127.0.0.1:{port}", timeout=5).weight_version
    assert info.value.kind == "unreachable" and info.value.status is None

    target = SGLangServerTarget(server.url, api_key="right", timeout=10)
    with pytest.raises(SGLangError, match="HTTP 404: Not Found") as info:
        target.request("POST", "/no_such_route", {})
    assert info.value.status == 404 and info.value.body == {"detail": "Not Found"}

    failing = FakeServer(runtime)
    servers.append(failing)
    ftarget = SGLangServerTarget(failing.url, timeout=10)
    assert ftarget.weight_version == 0
    failing.fail_update = "Failed to deserialize"  # SGLang's own 400 for the delta request
    with pytest.raises(SGLangError, match="Failed to deserialize") as info:
        ftarget.apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "engine"
    assert failing.paths()[-1] == "/continue_generation"  # generation resumed after the failure


def test_a_request_that_cannot_be_sent_is_an_sglang_error_that_never_quotes_the_key(servers):
    """http.client refuses a header value with a line break by raising ValueError quoting the header: the
    client maps it (and a URL it cannot send) to SGLangError ``config`` without the header, so no rank logs
    the key. A key that cannot travel in a header is refused when the target is built."""
    server = FakeServer(SchedulerRuntime([SGLangLlama(hf_state())]), api_key="s3cr3t-key")
    servers.append(server)
    for bad in ("s3cr3t-key\n", "s3cr3t-key\r\nX-Injected: 1", "s3cr3t key", "s3cr3t-key\u20ac"):
        with pytest.raises(SGLangError) as info:
            SGLangServerTarget(server.url, api_key=bad, timeout=10)
        assert info.value.kind == "config" and "s3cr3t" not in str(info.value)
    target = SGLangServerTarget(server.url, api_key="s3cr3t-key", timeout=10)
    assert target.weight_version == 0
    for bad in ("s3cr3t-key\n", "s3cr3t-key\u20ac"):  # set after the check: request() still keeps it out
        target.api_key = bad
        with pytest.raises(SGLangError) as info:
            target.request("GET", "/get_server_info")
        assert info.value.kind == "config" and "s3cr3t" not in str(info.value)
        assert "API key" in str(info.value) and info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(SGLangError, match="could not be sent") as info:
        SGLangServerTarget(server.url + "/x y\n", timeout=10).request("GET", "/get_server_info")
    assert info.value.kind == "config"


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_a_pipeline_parallel_engine_is_refused_for_deltas_before_anything_is_sent(transport, servers):
    """SGLang's ``--pp-size 2``: each stage holds only its layers, so a delta naming every layer cannot
    apply. The client refuses it from the server info alone (no pause, no read-back, no update), names the
    fix, turns fingerprints off, and still takes dense refits (SGLang's load_weights loads each stage's)."""
    from megatron_logra.rollout.sglang_engine import SGLangEngine

    hf = hf_state()
    runtime = SchedulerRuntime([SGLangLlama(hf)])  # holds the whole model: only the client's decisions are checked
    if transport == "engine":
        engine = FakeEngine(runtime)
        engine.server_args.pp_size = 2
        target = SGLangEngineTarget(engine)
    else:
        server = FakeServer(runtime)
        server.server_info["pp_size"] = 2  # get_server_info: dataclasses.asdict(server_args)
        servers.append(server)
        target = SGLangServerTarget(server.url, timeout=10)
    with pytest.raises(SGLangError, match=r"pp_size=2 pipeline stages.*sync\.mode=full.*--pp-size 1") as info:
        target.apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "config"
    if transport == "engine":
        assert engine.calls == []
    else:
        assert server.paths() == ["/server_info"]
    assert engine_version(runtime.models[0]) == 0 and runtime.dead is None
    with pytest.raises(SGLangError, match="pp_size=2") as info:  # every rank refuses when the engine is built
        SGLangEngine(generate_fn=lambda payload: None, target=target, vocab_size=V, padded_vocab_size=V)
    assert info.value.kind == "config"
    built = SGLangEngine(generate_fn=lambda payload: None, target=target, vocab_size=V, padded_vocab_size=V,
                         deltas=False)  # sync.mode=full
    assert built.weight_version == 0
    new = hf_state(seed=3)
    built.update_weights_full(new, 7)
    assert built.weight_version == 7 and engine_version(runtime.models[0]) == 7
    _assert_same(runtime.models[0], SGLangLlama(new))
    assert target.fingerprint() is None  # no stage can hash the whole model: drift checks are off, not faked


def test_http_target_checks_loader_and_version_before_pausing(servers):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    bare = FakeServer(runtime, server_info={"tp_size": 1, "custom_weight_loader": []})
    servers.append(bare)
    with pytest.raises(SGLangError, match="does not register the sketch-delta loader"):
        SGLangServerTarget(bare.url, timeout=10).apply_sketch_delta(delta_chain(1)[0])
    assert bare.paths() == ["/server_info"]

    server = FakeServer(runtime)
    servers.append(server)
    target = SGLangServerTarget(server.url, timeout=10)
    target.reset_version(2)
    n = len(server.requests)
    with pytest.raises(SyncError, match="base 0 != engine version 2|skips versions|engine at version 2"):
        target.apply_sketch_delta(random_delta(SHAPE, RANK, base_version=1, new_version=2))
    assert "/pause_generation" not in server.paths()[n:] and "/update_weights_from_tensor" not in server.paths()[n:]
    assert target.weight_version == 2 and runtime.dead is None


# --------------------------------------------------------------------------- the GPU smoke tool's checks


def _smoke_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "sglang_sync_smoke.py"
    spec = importlib.util.spec_from_file_location("sglang_sync_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _StandInDriver:
    """The smoke tool's driver interface over the CPU stand-in (greedy "generation" = a hash of the weights)."""

    name = "stand-in"

    def __init__(self, hf):
        self.runtime = SchedulerRuntime([SGLangLlama(hf)])
        self.target = SGLangEngineTarget(FakeEngine(self.runtime))

    def generate(self, prompts, n_tokens):
        digest = sum(int(v.float().sum().mul(1e4)) for v in engine_hf_view(self.runtime.models[0]).values())
        return [[(digest + 31 * i + j) % V for j in range(n_tokens)] for i, _ in enumerate(prompts)]

    def read(self, name):
        view = engine_hf_view(self.runtime.models[0])
        return view[name].float().clone() if name in view else None


def test_smoke_tool_check_passes_on_a_faithful_engine_and_catches_a_flipped_bit():
    smoke = _smoke_tool()
    hf = hf_state()
    deltas = delta_chain(3)
    res = smoke.check(_StandInDriver(hf), hf, deltas, n_tokens=4, report=lambda msg: None)
    assert res["passed"], res["failures"]
    assert res["weights_checked"] == len(hf) and res["weights_moved"] > 0 and res["fingerprint_checked"]
    assert res["bytes_per_sync"] < res["full_refit_bytes"]

    driver = _StandInDriver(hf)
    apply = driver.target.apply_sketch_delta

    def apply_then_corrupt(payload):  # an engine that silently flips one bit between two deltas
        version = apply(payload)
        if version == 2:
            w = driver.runtime.models[0].model.layers[1].mlp.down_proj.weight
            w.data.view(torch.int16)[0, 0] ^= 1
        return version

    driver.target.apply_sketch_delta = apply_then_corrupt
    res = smoke.check(driver, hf, deltas, n_tokens=4, report=lambda msg: None)
    assert not res["passed"]
    assert any("model.layers.1.mlp.down_proj.weight" in f for f in res["failures"])
    assert any("fingerprint drift" in f for f in res["failures"])

    # as at engine TP > 1: only replicated vectors are read back, the fingerprint still catches the bit
    vectors = lambda name: hf[name].dim() == 1  # noqa: E731
    res = smoke.check(_StandInDriver(hf), hf, deltas, n_tokens=4, report=lambda msg: None, readback=vectors)
    assert res["passed"], res["failures"]
    driver = _StandInDriver(hf)
    apply = driver.target.apply_sketch_delta
    driver.target.apply_sketch_delta = apply_then_corrupt
    res = smoke.check(driver, hf, deltas, n_tokens=4, report=lambda msg: None, readback=vectors)
    assert not res["passed"] and any("fingerprint drift" in f for f in res["failures"])


def test_smoke_tool_check_fails_an_engine_that_does_not_sample_the_rows_of_its_version(monkeypatch):
    """A loader that fingerprints without the version's salt samples the same rows at every version: the
    smoke check compares with the engine's own salt and also requires it to be the weight version."""
    smoke = _smoke_tool()
    hf = hf_state()
    deltas = delta_chain(3)
    res = smoke.check(_StandInDriver(hf), hf, deltas, n_tokens=4, report=lambda msg: None)
    assert res["passed"], res["failures"]
    assert res["fingerprint_salt"] == deltas[-1].new_version
    salted = sglang_loader.engine_fingerprint
    monkeypatch.setattr(sglang_loader, "engine_fingerprint",
                        lambda model, group=None, rows_per_tensor=4, salt=None: salted(model, group, rows_per_tensor))
    res = smoke.check(_StandInDriver(hf), hf, deltas, n_tokens=4, report=lambda msg: None)
    assert not res["passed"] and res["fingerprint_salt"] is None
    assert res["failures"] == ["the engine's fingerprint samples the rows of salt None, not of its weight version 3"]


def test_client_imports_neither_sglang_megatron_transformers_nor_requests():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = ("import sys\n"
              "for m in ('megatron', 'transformers', 'sglang', 'requests'): sys.modules[m] = None\n"
              "import megatron_logra.sync.sglang_client as c\n"
              "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformers', 'sglang', 'requests')"
              " and sys.modules[m] is not None]\n"
              "assert not bad, bad\n"
              "assert 'megatron_logra.sync.trainer' not in sys.modules\n"
              "print('CLIENT-OK', c.LOADER_PATH)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"CLIENT-OK {LOADER_PATH}" in out.stdout


# --------------------------------------------------------------------------- a served vocabulary the trainer pads


def _padded(t, rows, seed=3):
    """``t`` with the trainer's padding rows appended (not zero: a trainer's padding rows need not be)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([t, (torch.randn(rows - t.shape[0], *t.shape[1:], generator=gen) * 0.02).to(t.dtype)])


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_refits_and_deltas_cut_the_trainers_padded_vocabulary_to_the_served_models(transport, servers):
    """The trainer pads V=40 to 128 (model.make_vocab_size_divisible_by=128); the server was started from
    the unpadded checkpoint (config vocab_size 40; SGLang pads its own rows to 64). SGLang's embedding
    loader takes exactly 40 rows (the stand-in asserts as ``VocabParallelEmbedding.weight_loader``
    does), so the refit and the delta's dense embedding arrive cut to the rows the engine has."""
    hf, new = hf_state(), hf_state(seed=5)
    runtime = SchedulerRuntime([SGLangLlama(hf, vocab_pad=24)])
    if transport == "engine":
        target = SGLangEngineTarget(FakeEngine(runtime))
    else:
        server = FakeServer(runtime)
        servers.append(server)
        target = SGLangServerTarget(server.url, timeout=10)
    trainer = {k: _padded(v, 128) if k in ("model.embed_tokens.weight", "lm_head.weight") else v
               for k, v in new.items()}
    target.update_weights_full(trainer, 4)
    assert runtime.dead is None and target.weight_version == 4
    assert target.vocab_size == V  # the loader reports the served model's vocabulary
    _assert_same(runtime.models[0], SGLangLlama(new, vocab_pad=24))
    fp = target.fingerprint()
    assert fingerprint_salt(fp) == 4 and drift(fp, fingerprint(new, salt=4)) == []

    emb = _padded(torch.full((V, HID), 0.5, dtype=torch.bfloat16), 128)
    sent = random_delta(SHAPE, RANK, base_version=4, new_version=5, update_index=4, seed=11, generator_seed=4,
                        scale=2e-3, dense={"model.embed_tokens.weight": emb})
    assert target.apply_sketch_delta(encode(sent)) == 5
    expect = random_delta(SHAPE, RANK, base_version=4, new_version=5, update_index=4, seed=11, generator_seed=4,
                          scale=2e-3, dense={"model.embed_tokens.weight": emb[:V]})
    _assert_same(runtime.models[0], SGLangLlama(reference(new, [expect]), vocab_pad=24))
    assert runtime.dead is None

    short = dict(trainer, **{"model.embed_tokens.weight": new["model.embed_tokens.weight"][: V - 1]})
    with pytest.raises(SGLangError, match="vocab_size=40"):  # fewer rows than the engine's vocabulary: refused
        target.update_weights_full(short, 6)
    assert runtime.dead is None
