"""The SGLang rollout engine on CPU: config, the ``/generate`` translations, the log-prob convention,
and the missing-SGLang error (the one-driver-per-group sharing: ``tests/distributed/test_rollout_driver.py``).

SGLang cannot start here, so its side is a small stand-in (:class:`FakeSGLang`) that answers a
``/generate`` payload the way SGLang documents it (``output_ids``, ``meta_info.output_token_logprobs``
as ``(logprob, token_id, text)``, ``finish_reason``), sampling from a fixed bigram logit table with the
request's ``logit_bias`` and temperature; the engine's log-probs are compared with the trainer's
convention (``log_softmax(z / T)`` with padded columns at ``PADDED_LOGIT``) computed independently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_logra.models.gpt import PADDED_LOGIT
from megatron_logra.rl.config import RolloutConfig
from megatron_logra.rollout import build_engine
from megatron_logra.rollout.engine import SamplingParams
from megatron_logra.rollout.sglang_api import (
    PADDED_LOGIT_BIAS,
    build_generate_payload,
    check_logprob_convention,
    engine_context_length,
    engine_hf_config,
    parse_generate_response,
    request_seeds,
    require_sglang,
    sglang_mem_fraction,
)
from megatron_logra.rollout.sglang_checks import check_engine_dtype
from megatron_logra.rollout.sglang_engine import SGLangEngine
from megatron_logra.rollout.sglang_env import engine_start_environment
from megatron_logra.sync import SyncError
from megatron_logra.sync.sglang_client import SGLangServerTarget
from support.sglang_stand_ins import PADDED, VOCAB, FakeSGLang, FakeTarget



def _trainer_logprobs(table: torch.Tensor, prompt: list[int], completion: list[int], temperature: float):
    """The trainer's convention, computed independently: padded columns at PADDED_LOGIT, log_softmax(z/T)."""
    out, last = [], prompt[-1]
    for tok in completion:
        z = table[last].clone()
        z[VOCAB:] = PADDED_LOGIT
        out.append(float(torch.log_softmax(z / (temperature or 1.0), -1)[tok]))
        last = tok
    return out


def _engine(fake=None, target=None, **kw) -> SGLangEngine:
    return SGLangEngine(generate_fn=fake or FakeSGLang(), target=target or FakeTarget(), vocab_size=VOCAB,
                        padded_vocab_size=PADDED, **kw)


# --------------------------------------------------------------------------- config


def test_rollout_config_accepts_sglang_and_validates_its_fields():
    cfg = RolloutConfig(engine="sglang", sglang_url="http://127.0.0.1:30000", mem_fraction_static=0.5, sglang_tp=2)
    assert cfg.engine == "sglang" and cfg.sglang_tp == 2
    bad = [
        (dict(engine="vllm"), "rl.rollout.engine"),
        (dict(sglang_url="http://x:1"), "rl.rollout.sglang_url"),
        (dict(engine="sglang", sglang_url="127.0.0.1:30000"), "rl.rollout.sglang_url"),
        (dict(engine="sglang", mem_fraction_static=0.0), "rl.rollout.mem_fraction_static"),
        (dict(engine="sglang", mem_fraction_static=1.0), "rl.rollout.mem_fraction_static"),
        (dict(engine="sglang", sglang_tp=-1), "rl.rollout.sglang_tp"),
        (dict(engine="sglang", sglang_serialization="json"), "rl.rollout.sglang_serialization"),
        (dict(engine="sglang", sglang_timeout=0), "rl.rollout.sglang_timeout"),
        (dict(engine="sglang", sglang_engine_args=["x"]), "rl.rollout.sglang_engine_args"),
    ]
    for kwargs, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            RolloutConfig(**kwargs)


def test_auto_serialization_sends_bytes_to_every_server_and_handles_only_when_asked():
    """``auto`` never picks CUDA IPC, not even for a loopback server on a CUDA machine: a server started on GPUs
    of its own (``CUDA_VISIBLE_DEVICES=7 python -m sglang.launch_server ...``, docs/gpu.md) cannot open a
    handle to memory on the trainer's GPU (SGLang ``srt/utils/patch_torch.py``, 0.5.x: ``_device_from_maybe_uuid``
    looks the handle's device UUID up among the server's visible devices and raises for one it does not see)."""
    from megatron_logra.rollout.sglang_api import resolve_serialization

    assert RolloutConfig().sglang_serialization == "auto"
    for url in ("http://127.0.0.1:30000", "http://localhost:8000/", "http://[::1]:30000", "http://10.0.0.7:30000",
                "https://sglang.cluster.internal:443"):
        for cuda in (True, False):
            assert resolve_serialization("auto", url, cuda_available=cuda) == "pickle", (url, cuda)
    assert resolve_serialization("pickle", "http://127.0.0.1:1", cuda_available=True) == "pickle"
    assert resolve_serialization("cuda_ipc", "http://127.0.0.1:1", cuda_available=True) == "cuda_ipc"


def test_large_recipes_roll_out_with_sglang():
    from megatron_logra.config.recipes_large import LARGE_RECIPES

    for name, recipe in LARGE_RECIPES.items():
        cfg = recipe()
        assert cfg.rl.rollout.engine == "sglang", name
        # weights come from model.hf_path: never a supervised warm start (and whole-model save) at these sizes
        assert cfg.sft.steps == 0 and not cfg.sft.cache, name


# --------------------------------------------------------------------------- translations


def test_payload_carries_sampling_params_logprobs_and_padded_bias():
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=5, stop_token_ids=[3, 2, 3], seed=11)
    p = build_generate_payload([[1, 2], [5]], params, vocab_size=VOCAB, padded_vocab_size=PADDED)
    assert p["input_ids"] == [[1, 2], [5]] and p["return_logprob"] is True
    sp = p["sampling_params"]
    assert sp["temperature"] == 0.7 and sp["top_p"] == 1.0 and sp["max_new_tokens"] == 5
    assert sp["stop_token_ids"] == [2, 3]
    assert sp["logit_bias"] == {str(i): PADDED_LOGIT_BIAS for i in range(VOCAB, PADDED)}
    assert PADDED_LOGIT_BIAS == PADDED_LOGIT
    json.dumps(p)  # travels as JSON
    seeded = build_generate_payload([[1], [2]], params, vocab_size=VOCAB, padded_vocab_size=VOCAB, send_seed=True)
    assert [s["sampling_seed"] for s in seeded["sampling_params"]] == request_seeds(11, 2)
    assert "logit_bias" not in seeded["sampling_params"][0]
    greedy = build_generate_payload([[1]], SamplingParams(temperature=0), vocab_size=VOCAB, padded_vocab_size=PADDED)
    assert greedy["sampling_params"]["temperature"] == 0.0
    with pytest.raises(ValueError, match="empty"):
        build_generate_payload([], params, vocab_size=VOCAB, padded_vocab_size=PADDED)


def _documented_response():
    # shaped as SGLang's /generate answers a batch of two input_ids prompts with return_logprob=True
    return [
        {"output_ids": [17, 4, 2],
         "meta_info": {"id": "a", "prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0,
                       "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "7",
                       "output_token_logprobs": [[-0.5, 17, None], [-1.25, 4, None], [-0.125, 2, None]]}},
        {"output_ids": [9, 9],
         "meta_info": {"id": "b", "prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0,
                       "finish_reason": {"type": "length", "length": 2}, "weight_version": "7",
                       "output_token_logprobs": [(-2.0, 9, None), (-0.25, 9, None)]}},
    ]


def test_parse_documented_response():
    rollouts = parse_generate_response(_documented_response(), [[1, 2, 3], [5]], weight_version=7)
    assert [r.completion_ids for r in rollouts] == [[17, 4, 2], [9, 9]]
    assert [r.logprobs for r in rollouts] == [[-0.5, -1.25, -0.125], [-2.0, -0.25]]
    assert [r.finished for r in rollouts] == [True, False]
    assert [r.prompt_ids for r in rollouts] == [[1, 2, 3], [5]]
    assert all(r.weight_version == 7 for r in rollouts)
    single = parse_generate_response(_documented_response()[0], [[1, 2, 3]], weight_version=7)
    assert single[0].completion_ids == [17, 4, 2]
    tagless = _documented_response()
    for out in tagless:
        out["meta_info"]["weight_version"] = "default"  # SGLang's tag before any update_weight_version
    assert len(parse_generate_response(tagless, [[1], [5]], weight_version=0)) == 2


def test_stop_token_as_the_last_allowed_token_is_finished():
    """SGLang tests the length cap before the stop ids: a stop token drawn as the last allowed token
    reports "length". The rollout ended on its stop token all the same (as the embedded engine says)."""
    resp = _documented_response()
    resp[0]["meta_info"]["finish_reason"] = {"type": "length", "length": 3}  # [17, 4, 2] ends on stop id 2
    rollouts = parse_generate_response(resp, [[1, 2, 3], [5]], weight_version=7, stop_token_ids=[2])
    assert [r.finished for r in rollouts] == [True, False]  # [9, 9] was cut by the cap
    assert parse_generate_response(resp, [[1, 2, 3], [5]], weight_version=7, stop_token_ids=[9])[1].finished

    def capped_at_the_stop(payload):
        assert payload["sampling_params"]["max_new_tokens"] == 3
        return resp[:1]

    engine = _engine(capped_at_the_stop, FakeTarget(version=7))  # the engine passes the request's stop ids on
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, stop_token_ids=[2]))
    assert out[0].completion_ids == [17, 4, 2] and out[0].finished


@pytest.mark.parametrize("break_it, match", [
    (lambda r: r[0]["meta_info"].pop("output_token_logprobs"), "return_logprob"),
    (lambda r: r[0]["meta_info"]["output_token_logprobs"].pop(), "output_token_logprobs for 3"),
    (lambda r: r[0]["meta_info"]["output_token_logprobs"].__setitem__(1, [-1.0, 5, None]), "token 1"),
    (lambda r: r[1]["meta_info"].__setitem__("finish_reason", {"type": "abort", "message": "x"}), "abort"),
    (lambda r: r[1]["meta_info"].__setitem__("weight_version", "6"), "weight_version 6"),
    (lambda r: r.pop(), "for 2 prompts"),
    (lambda r: r[0].pop("output_ids"), "output_ids"),
])
def test_parse_rejects_inconsistent_responses(break_it, match):
    resp = _documented_response()
    break_it(resp)
    with pytest.raises(ValueError, match=match):
        parse_generate_response(resp, [[1, 2, 3], [5]], weight_version=7)


def test_logprob_convention_checks(caplog):
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "true"}
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        check_logprob_convention(SamplingParams(temperature=0.7), env)
    check_logprob_convention(SamplingParams(temperature=1.0), env)  # softmax(z) is softmax(z/1)
    check_logprob_convention(SamplingParams(temperature=0.0), env)  # greedy reports softmax(z) anyway
    with pytest.raises(ValueError, match="RETURN_ORIGINAL_LOGPROB"):
        check_logprob_convention(SamplingParams(temperature=2.0), {"RETURN_ORIGINAL_LOGPROB": "1"})
    with caplog.at_level(logging.WARNING):
        check_logprob_convention(SamplingParams(temperature=1.0, top_p=0.9), {})
    assert "nucleus" in caplog.text


def test_engine_hf_config_names_the_architecture():
    from megatron_logra.models.gpt import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100,
                      seq_length=64)
    hf = engine_hf_config(cfg, tp=2)
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["vocab_size"] == cfg.padded_vocab_size(2)
    assert hf["rope_theta"] == float(cfg.rotary_base) and hf["num_hidden_layers"] == 2
    assert hf["torch_dtype"] == cfg.params_dtype == "float32"
    assert hf["max_position_embeddings"] == engine_context_length(cfg) > cfg.seq_length + 1
    json.dumps(hf)


def test_mem_fraction_is_of_the_memory_free_at_engine_start():
    # SGLang's ModelRunner: KV = free_after_weights - pre_model_load_free * (1 - f), so the engine takes
    # pre_model_load_free * f; a 0.3 share of an 80 GiB GPU with 60 GiB free is f = 24 / 60 = 0.4
    gib = 1 << 30
    assert sglang_mem_fraction(0.3, free_bytes=80 * gib, total_bytes=80 * gib) == pytest.approx(0.3)
    assert sglang_mem_fraction(0.3, free_bytes=60 * gib, total_bytes=80 * gib) == pytest.approx(0.4)
    assert 60 * sglang_mem_fraction(0.3, free_bytes=60 * gib, total_bytes=80 * gib) == pytest.approx(0.3 * 80)
    assert sglang_mem_fraction(0.3, free_bytes=24 * gib, total_bytes=80 * gib) == pytest.approx(0.95)  # capped
    with pytest.raises(ValueError, match="only 0.25 of the GPU is free"):
        sglang_mem_fraction(0.3, free_bytes=20 * gib, total_bytes=80 * gib)


def test_missing_sglang_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=r"megatron-logra\[sglang\]"):
        require_sglang()
    cfg = SimpleNamespace(
        rl=SimpleNamespace(rollout=RolloutConfig(engine="sglang")),
        model=SimpleNamespace(vocab_size=VOCAB, padded_vocab_size=lambda tp: PADDED, seq_length=64,
                              params_dtype="bfloat16"),
        train=SimpleNamespace(run_dir="/nonexistent/run", seed=0), sync=SimpleNamespace(mode="delta"),
        optimizer=SimpleNamespace(name="logra"))
    groups = SimpleNamespace(mp=None, tp_size=1, dp_rank=0)
    with pytest.raises(ImportError, match="rl.rollout.engine='sglang'"):
        build_engine(cfg, None, groups)


def test_in_process_engine_refuses_a_dtype_sglang_kernels_lack(monkeypatch, tmp_path):
    """SGLang's CUDA kernels (RMSNorm, fused RoPE) are fp16/bf16 only and the in-process engine runs in
    ``model.params_dtype``: a float32 trainer (the tiny recipe) is refused on every rank at build time,
    before SGLang is imported, naming the field and the fix."""
    from megatron_logra.config import load_recipe

    monkeypatch.setitem(sys.modules, "sglang", None)  # the dtype is refused first
    cfg = load_recipe("tiny")
    assert cfg.model.params_dtype == "float32"
    cfg.train.run_dir = str(tmp_path)
    cfg.rl.rollout = RolloutConfig(engine="sglang")
    groups = SimpleNamespace(mp=None, tp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match=r"model\.params_dtype='float32'.*set model\.params_dtype=bfloat16"):
        build_engine(cfg, None, groups)
    assert not (tmp_path / "sglang_model").exists()
    for bad in ("float32", "float64"):
        with pytest.raises(ValueError, match="model.params_dtype"):
            check_engine_dtype(bad)
    for good in ("bfloat16", "float16"):
        check_engine_dtype(good)
        cfg.model.params_dtype = good
        with pytest.raises(ImportError, match="rl.rollout.engine='sglang'"):  # past the check: SGLang's import
            build_engine(cfg, None, groups)


def test_sglang_rollout_smoke_runs_a_bf16_trainer(tmp_path):
    """``tools/sglang_rollout_smoke.py`` (and the GPU test running it) starts an in-process engine
    from the float32 tiny recipe: its config must be one the engine accepts."""
    from tool_modules import load_tool

    cfg = load_tool("sglang_rollout_smoke").smoke_config(2, run_dir=tmp_path / "run")
    assert cfg.model.params_dtype == "bfloat16" and cfg.rl.rollout.engine == "sglang" and not cfg.rl.rollout.sglang_url
    assert (cfg.sync.mode, cfg.sync.check_interval, cfg.rl.steps) == ("delta", 1, 2)
    check_engine_dtype(cfg.model.params_dtype)


# --------------------------------------------------------------------------- the engine, one process


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_engine_logprobs_match_the_trainer_convention(temperature):
    fake = FakeSGLang(as_tuples=temperature != 0.6)
    engine = _engine(fake)
    prompts = [[1, 2, 3], [7], [30, 31]]
    params = SamplingParams(temperature=temperature, max_new_tokens=6, stop_token_ids=[5])
    rollouts = engine.generate(prompts, params)
    assert len(rollouts) == 3
    for p, r in zip(prompts, rollouts):
        assert max(r.completion_ids) < VOCAB  # padded ids are never drawn
        assert r.finished == (r.completion_ids[-1] == 5)
        want = _trainer_logprobs(fake.table, p, r.completion_ids, temperature)
        assert r.logprobs == pytest.approx(want, abs=1e-9)


def test_engine_delegates_sync_and_tracks_the_version():
    target = FakeTarget(version=3)
    fake = FakeSGLang()
    engine = _engine(fake, target)
    assert engine.weight_version == 3
    assert engine.apply_sketch_delta(b"ok") == 4 and engine.weight_version == 4
    with pytest.raises(SyncError, match="does not follow") as err:
        engine.apply_sketch_delta("bad")
    assert err.value.kind == "gap" and engine.weight_version == 4
    engine.update_weights_full({}, 10)
    assert engine.weight_version == 10 and engine.fingerprint() == {"w": "hash-10"}
    fake.weight_version = "10"
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].weight_version == 10
    fake.weight_version = "9"
    with pytest.raises(ValueError, match="weight_version 9"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[VOCAB]], SamplingParams(max_new_tokens=2))
    assert target.calls == ["delta", "delta", "full"]


def test_engine_over_http_generate():
    """The payload and the response survive JSON over a real HTTP round trip (SGLang's /generate route)."""
    fake = FakeSGLang(as_tuples=False)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(fake(body) if self.path == "/generate" else {"error": "no route"}).encode()
            self.send_response(200 if self.path == "/generate" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = SGLangServerTarget(f"http://127.0.0.1:{server.server_address[1]}", timeout=30)
        engine = _engine(lambda payload: client.request("POST", "/generate", payload)[1])
        rollouts = engine.generate([[1, 2], [3]], SamplingParams(temperature=0.8, max_new_tokens=4))
    finally:
        server.shutdown()
        server.server_close()
    for p, r in zip([[1, 2], [3]], rollouts):
        assert r.logprobs == pytest.approx(_trainer_logprobs(fake.table, p, r.completion_ids, 0.8), abs=1e-9)


TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "8", "ROLE_NAME": "default",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "0"}
"""What torchrun exports to every worker (``LocalElasticAgent._start_workers``)."""


def _torchrun_environment(monkeypatch, absent=("TORCHELASTIC_ERROR_FILE", "NCCL_CUMEM_ENABLE", "SGLANG_STARTED")):
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for key in absent:
        monkeypatch.delenv(key, raising=False)


def _sglang_start_writes_its_environment():
    """What SGLang's start does in the caller's process (``_set_envs_and_config``), plus torchrun-named
    variables set while they were hidden, which must not outlive the start either."""
    import os

    os.environ.update(CUDA_DEVICE_MAX_CONNECTIONS="4", NCCL_CUMEM_ENABLE="0", MASTER_PORT="31000",
                      TORCHELASTIC_ERROR_FILE="/tmp/x", SGLANG_STARTED="1")


@pytest.mark.parametrize("fails", [False, True])
def test_engine_start_hides_torchrun_and_restores_the_environment_exactly(monkeypatch, fails):
    """torchrun's ``TORCHELASTIC_USE_AGENT_STORE=True`` makes every rank of the schedulers' own
    process-group init a TCPStore client (nobody serves it: a hang), so the start must not see
    it; afterwards the trainer's environment is back exactly, also when the start raised."""
    import os

    _torchrun_environment(monkeypatch)
    before = dict(os.environ)
    seen = {}
    with contextlib.suppress(RuntimeError):
        with engine_start_environment():
            seen.update(os.environ)
            _sglang_start_writes_its_environment()
            if fails:
                raise RuntimeError("scheduler died")
    leaked = sorted(k for k in seen if k in TORCHRUN_ENV or k.startswith("TORCHELASTIC_"))
    assert not leaked, f"the start saw torchrun's {leaked}"
    assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    after = dict(os.environ)
    assert after.pop("SGLANG_STARTED") == "1"  # anything else SGLang set is left as it set it
    assert after == before


def test_in_process_start_asks_for_deterministic_sampling_and_keeps_the_trainer_environment(monkeypatch, tmp_path):
    """``sglang.Engine`` cannot start on a CPU: a stand-in records the environment its constructor
    (which spawns SGLang's schedulers) sees, does what its start does in the caller's process
    (``_set_envs_and_config``: CUDA/NCCL variables for its workers) and serves the loader through the
    scheduler stand-in of ``support.sglang_stand_ins``."""
    import os

    from support.sglang_stand_ins import FakeEngine, SchedulerRuntime, SGLangQwen2, hf_state

    from megatron_logra.config import load_recipe

    started, fail = [], []

    def engine(**kwargs):
        started.append((kwargs, dict(os.environ)))
        _sglang_start_writes_its_environment()
        if fail:
            raise RuntimeError("scheduler died")
        model = SGLangQwen2(hf_state())  # SGLang builds the model from the config the engine was given
        model.config.vocab_size = json.loads((Path(kwargs["model_path"]) / "config.json").read_text())["vocab_size"]
        fake = FakeEngine(SchedulerRuntime([model], loaders=kwargs["custom_weight_loader"]))
        fake.shutdown = lambda: None
        return fake

    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(Engine=engine))
    _torchrun_environment(monkeypatch)
    trainer_env = dict(os.environ)
    cfg = load_recipe("tiny")
    cfg.model.params_dtype = "bfloat16"
    cfg.train.run_dir = str(tmp_path)
    groups = SimpleNamespace(mp=None, tp_size=1, dp_rank=0)
    for seeded in (True, False):
        cfg.rl.rollout = RolloutConfig(engine="sglang", sglang_sampling_seed=seeded)
        built = build_engine(cfg, None, groups)
        kwargs, env_inside = started[-1]
        assert kwargs.get("enable_deterministic_inference", False) is seeded
        assert kwargs["dtype"] == "bfloat16"
        leaked = sorted(set(TORCHRUN_ENV) & set(env_inside))
        assert not leaked, f"the schedulers would see torchrun's {leaked}"
        assert env_inside["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert {k: v for k, v in os.environ.items() if k != "SGLANG_STARTED"} == trainer_env
        assert built.weight_version == 0  # the loader state reads back from a class without get_weights_by_name
        assert built.engine_vocab_size == cfg.model.padded_vocab_size(1)  # the in-process engine is padded
        built.close()
    fail.append(True)  # the stand-in's start fails
    with pytest.raises(RuntimeError, match="scheduler died"):
        build_engine(cfg, None, groups)
    assert not set(TORCHRUN_ENV) & set(started[-1][1]), "a failing start saw torchrun's variables"
    assert {k: v for k, v in os.environ.items() if k != "SGLANG_STARTED"} == trainer_env


def test_an_engine_that_cannot_take_deltas_is_refused_at_start_only_when_deltas_will_be_sent(monkeypatch, tmp_path):
    """``from_config`` expects sketch deltas exactly when ``PolicySync`` sends them (``sync.mode=delta`` with
    LoGRA): a pipeline-parallel engine is then refused when it is built, and accepted for dense refits."""
    from support.sglang_stand_ins import FakeEngine, SchedulerRuntime, SGLangQwen2, hf_state

    from megatron_logra.config import load_recipe
    from megatron_logra.sync.sglang_client import SGLangError

    def engine(**kwargs):
        model = SGLangQwen2(hf_state())
        model.config.vocab_size = json.loads((Path(kwargs["model_path"]) / "config.json").read_text())["vocab_size"]
        fake = FakeEngine(SchedulerRuntime([model], loaders=kwargs["custom_weight_loader"]))
        fake.server_args.pp_size = kwargs.get("pp_size", 1)
        fake.shutdown = lambda: None
        return fake

    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(Engine=engine))
    cfg = load_recipe("tiny")
    cfg.model.params_dtype = "bfloat16"
    cfg.train.run_dir = str(tmp_path)
    cfg.rl.rollout = RolloutConfig(engine="sglang", sglang_engine_args={"pp_size": 2})
    groups = SimpleNamespace(mp=None, tp_size=1, dp_rank=0)
    assert cfg.sync.mode == "delta" and cfg.optimizer.name == "logra"
    with pytest.raises(SGLangError, match=r"pp_size=2.*sync\.mode=full") as info:
        build_engine(cfg, None, groups)
    assert info.value.kind == "config"
    for mode, optimizer in (("full", "logra"), ("delta", "adam")):
        cfg.sync.mode, cfg.optimizer.name = mode, optimizer
        built = build_engine(cfg, None, groups)
        assert built.weight_version == 0
        built.close()


# --------------------------------------------------------------------------- a served vocabulary the trainer pads


def test_requests_bias_only_the_padded_ids_the_served_model_has():
    """SGLang refuses a request whose ``logit_bias`` names an id past its model's vocab_size
    (``SamplingParams.verify``; ``FakeSGLang`` does the same): a server started from the unpadded
    checkpoint gets no bias (it lacks the padded ids), one with 44 ids gets 40..43, the padded
    in-process engine all of 40..47. Log-probs match the trainer's in every case."""
    prompts, params = [[1, 2, 3], [7]], SamplingParams(temperature=0.8, max_new_tokens=6, seed=3)
    for served, biased in ((VOCAB, None), (44, range(VOCAB, 44)), (PADDED, range(VOCAB, PADDED))):
        fake = FakeSGLang(vocab_size=served)
        engine = _engine(fake, FakeTarget(vocab_size=served))
        rollouts = engine.generate(prompts, params)
        assert engine.engine_vocab_size == served
        bias = fake.payloads[-1]["sampling_params"].get("logit_bias")
        assert (None if bias is None else sorted(map(int, bias))) == (None if biased is None else list(biased))
        for p, r in zip(prompts, rollouts):
            assert max(r.completion_ids) < VOCAB
            assert r.logprobs == pytest.approx(_trainer_logprobs(fake.table, p, r.completion_ids, 0.8), abs=1e-9)
        # the drift check compares the rows the engine serves: the trainer fingerprints as many
        assert engine.fingerprint() is not None
        assert engine.fingerprint_vocab_rows == (served if served < PADDED else None)


@pytest.mark.parametrize("served", [VOCAB - 1, PADDED + 1])
def test_a_served_vocabulary_outside_the_trainers_is_refused_at_start(served):
    with pytest.raises(ValueError, match=rf"vocab_size={served}.*make_vocab_size_divisible_by"):
        _engine(target=FakeTarget(vocab_size=served))
