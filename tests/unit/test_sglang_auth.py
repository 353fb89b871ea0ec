"""The HTTP client's keys and server-info path against SGLang's auth rules, and the per-rank IPC entries.

Newer SGLang servers take ``--admin-api-key`` besides ``--api-key``: its weight routes are admin-level and,
with both keys set, accept only the admin key, while every other route accepts only the API key
(``FakeServer`` follows SGLang's ``decide_request_auth``). Newer servers also move ``/get_server_info`` to
``/server_info``. Over CUDA IPC every scheduler must get its own serialization.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.rl.config import RolloutConfig
from megatron_logra.rollout.sglang_setup import (ADMIN_API_KEY_ENV, ADMIN_KEY_FIELD, REDACTED_API_KEY, redact_config,
                                                 resolve_api_key)
from megatron_logra.sync.sglang_client import SGLangError, SGLangServerTarget, rank_entries, serialize_named_tensors
from megatron_logra.sync.sglang_loader import engine_version
from support.sglang_stand_ins import (ADMIN_OPTIONAL_ROUTES, FakeServer, SchedulerRuntime, SGLangLlama, delta_chain,
                                      hf_state, reference, servers)  # noqa: F401  (servers: a fixture)


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if not n.startswith("logra_sync")}


@pytest.mark.parametrize("api_key", ["user", None])
def test_the_admin_key_goes_to_weight_routes_and_the_api_key_elsewhere(servers, api_key):
    hf = hf_state()
    runtime = SchedulerRuntime([SGLangLlama(hf)])
    server = FakeServer(runtime, api_key=api_key, admin_api_key="admin")
    servers.append(server)
    target = SGLangServerTarget(server.url, api_key=api_key, admin_api_key="admin", timeout=10)
    deltas = delta_chain(3)
    for d in deltas:
        assert target.apply_sketch_delta(d) == d.new_version
    want = _weights(SGLangLlama(reference(hf, deltas)))
    got = _weights(runtime.models[0])
    assert all(torch.equal(got[n], want[n]) for n in want)

    user = f"Bearer {api_key}" if api_key else None
    for r in server.requests:
        sent = r["headers"].get("authorization")
        if r["path"] in ADMIN_OPTIONAL_ROUTES:
            assert sent == "Bearer admin", r
        elif r["path"] not in ("/pause_generation", "/continue_generation"):
            assert sent == user, r
    # the control routes are normal here: one refused try with the admin key, then the API key every time
    pauses = [r["headers"].get("authorization") for r in server.requests if r["path"] == "/pause_generation"]
    if api_key:
        assert pauses == ["Bearer admin"] + [user] * len(deltas)
    else:  # no API key: the route is open, and the admin key it was sent is not refused
        assert pauses == ["Bearer admin"] * len(deltas)


def test_an_api_key_alone_is_refused_by_a_server_with_an_admin_key_naming_the_fix(servers):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    before = {n: p.clone() for n, p in _weights(runtime.models[0]).items()}
    server = FakeServer(runtime, api_key="user", admin_api_key="admin")
    servers.append(server)
    with pytest.raises(SGLangError) as info:
        SGLangServerTarget(server.url, api_key="user", timeout=10).apply_sketch_delta(delta_chain(1)[0])
    assert info.value.kind == "auth" and info.value.status == 401
    assert "admin_api_key" in str(info.value) and ADMIN_API_KEY_ENV in str(info.value)
    assert "user" not in str(info.value).replace("/update", "")  # the key itself is never quoted
    assert engine_version(runtime.models[0]) == 0
    assert all(torch.equal(p, before[n]) for n, p in _weights(runtime.models[0]).items())


def test_server_info_falls_back_to_the_older_path_and_keeps_the_one_that_answered(servers):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    old = FakeServer(runtime, info_paths=("/get_server_info",))
    none = FakeServer(runtime, info_paths=())
    servers += [old, none]
    target = SGLangServerTarget(old.url, timeout=10)
    assert target.server_info()["tp_size"] == 1 and target.server_info()["tp_size"] == 1
    assert old.paths() == ["/server_info", "/get_server_info", "/get_server_info"]
    with pytest.raises(SGLangError, match="answers neither") as info:
        SGLangServerTarget(none.url, timeout=10).server_info()
    assert info.value.kind == "http"
    new = FakeServer(runtime)  # both paths; then restarted as an older version with only the older one
    servers.append(new)
    target = SGLangServerTarget(new.url, timeout=10)
    assert target.server_info()["tp_size"] == 1
    new.info_paths = ("/get_server_info",)
    assert target.server_info()["tp_size"] == 1
    assert new.paths() == ["/server_info", "/server_info", "/get_server_info"]


def test_each_rank_gets_its_own_ipc_serialization_and_shares_one_by_value():
    calls = []

    def counting(named, serialization):
        calls.append(serialization)
        return f"{serialization}-{len(calls)}"

    named = [("model.norm.weight", torch.ones(4))]
    assert rank_entries(named, "cuda_ipc", 4, counting) == [f"cuda_ipc-{i}" for i in range(1, 5)]
    calls.clear()
    assert rank_entries(named, "pickle", 4, counting) == ["pickle-1"] * 4 and calls == ["pickle"]
    real = rank_entries(named, "pickle", 2)
    assert real == [serialize_named_tensors(named, "pickle")] * 2


def test_the_admin_key_is_resolved_and_kept_off_disk_like_the_api_key():
    data = {"rl": {"rollout": {"sglang_api_key": "k1", "sglang_admin_api_key": "k2"}}}
    safe = redact_config(data)
    assert safe["rl"]["rollout"] == {"sglang_api_key": REDACTED_API_KEY, "sglang_admin_api_key": REDACTED_API_KEY}
    assert data["rl"]["rollout"]["sglang_admin_api_key"] == "k2"
    assert RolloutConfig(sglang_admin_api_key=REDACTED_API_KEY).sglang_admin_api_key == ""
    with pytest.raises(ValueError, match="rl.rollout.sglang_admin_api_key must be a string"):
        RolloutConfig(sglang_admin_api_key=7)
    env = {ADMIN_API_KEY_ENV: "admin\n", "SGLANG_API_KEY": "user"}
    assert resolve_api_key("", env, field=ADMIN_KEY_FIELD, env_var=ADMIN_API_KEY_ENV) == "admin"
    assert resolve_api_key("", env) == "user"
    assert resolve_api_key("given", env, field=ADMIN_KEY_FIELD, env_var=ADMIN_API_KEY_ENV) == "given"
    with pytest.raises(ValueError, match=ADMIN_API_KEY_ENV):
        resolve_api_key("", {ADMIN_API_KEY_ENV: "a b"}, field=ADMIN_KEY_FIELD, env_var=ADMIN_API_KEY_ENV)
