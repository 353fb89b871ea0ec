"""The field names the SGLang clients send, pinned against what SGLang's source declares.

SGLang builds its request objects from our JSON / keyword arguments by name: ``SamplingParams(**d)``
(a ``msgspec.Struct`` with ``kw_only=True`` in current SGLang, a plain class in older ones: an unknown
key fails the whole request), the ``io_struct`` dataclasses behind each HTTP route, and
``ServerArgs(**kwargs)`` behind ``sglang.Engine``. The name sets below are transcribed from SGLang's
source (v0.5.x and main, 2025-2026); each test checks that every name we send is one SGLang knows.
"""

from __future__ import annotations

import pytest

from megatron_logra.rollout.engine import SamplingParams
from megatron_logra.rollout.sglang_api import build_generate_payload, check_engine_kwargs
from megatron_logra.sync.sglang_client import SGLangServerTarget
from megatron_logra.sync.sglang_wire import LOADER_PATH

# sglang python/sglang/srt/sampling/sampling_params.py: SamplingParams (the API fields callers may set)
SGLANG_SAMPLING_PARAMS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed"}

# sglang python/sglang/srt/entrypoints/engine.py: Engine.generate (the keyword arguments we use)
SGLANG_GENERATE_KWARGS = {"prompt", "sampling_params", "input_ids", "return_logprob", "logprob_start_len",
                          "top_logprobs_num", "token_ids_logprob", "stream", "rid"}

# sglang python/sglang/srt/managers/io_struct.py (v0.5.x)
SGLANG_UPDATE_FROM_TENSOR = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                             "weight_version"}  # UpdateWeightsFromTensorReqInput
SGLANG_GET_WEIGHTS_BY_NAME = {"name", "truncate_size"}  # GetWeightsByNameReqInput
SGLANG_UPDATE_WEIGHT_VERSION = {"new_version", "abort_all_requests"}  # UpdateWeightVersionReqInput
SGLANG_PAUSE = {"mode"}  # PauseGenerationReqInput (0.5.9: a body; 0.5.3: the route takes none)

# sglang python/sglang/srt/server_args.py: ServerArgs fields the in-process engine passes
SGLANG_SERVER_ARGS = {
    "model_path", "load_format", "dtype", "tp_size", "base_gpu_id", "mem_fraction_static", "skip_tokenizer_init",
    "random_seed", "context_length", "custom_weight_loader", "log_level", "enable_deterministic_inference",
    "attention_backend", "disable_cuda_graph", "disable_radix_cache", "dp_size", "pp_size", "enable_dp_attention"}


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 8, "stop_token_ids": [2], **kw})


@pytest.mark.parametrize("send_seed", [False, True])
def test_generate_payload_uses_only_names_sglang_declares(send_seed):
    payload = build_generate_payload([[1, 2, 3], [4]], _params(seed=3), vocab_size=10, padded_vocab_size=16,
                                     send_seed=send_seed, engine_vocab_size=12)
    assert set(payload) <= SGLANG_GENERATE_KWARGS  # also Engine.generate(**payload)
    sampling = payload["sampling_params"]
    for sp in (sampling if isinstance(sampling, list) else [sampling]):
        assert set(sp) <= SGLANG_SAMPLING_PARAMS
        # SamplingParams.logit_bias: Dict[str, float]; verify() checks int(key) in [0, vocab_size)
        assert all(isinstance(k, str) and 10 <= int(k) < 12 for k in sp["logit_bias"])
        assert ("sampling_seed" in sp) == send_seed
        if send_seed:  # int32 in SGLang's seeded sampler
            assert isinstance(sp["sampling_seed"], int) and 0 <= sp["sampling_seed"] < 2**31
    assert isinstance(sampling, list) == send_seed and payload["return_logprob"] is True


def test_http_bodies_use_only_io_struct_fields(monkeypatch):
    sent = []
    target = SGLangServerTarget("http://127.0.0.1:9")

    def request(method, path, body=None, *, ok_status=()):
        sent.append((path, body))
        if path in ("/server_info", "/get_server_info"):
            return 200, {"tp_size": 1, "custom_weight_loader": [LOADER_PATH]}
        if path == "/update_weights_from_tensor":
            return 200, {"success": True, "message": "Success"}
        return 200, [0.0]

    monkeypatch.setattr(target, "request", request)
    import torch

    target._update([("w", torch.zeros(2))], LOADER_PATH, True)
    target._read_param("logra_sync_state")
    target._pause()
    target._continue()
    target._publish_version(3)
    fields = {"/update_weights_from_tensor": SGLANG_UPDATE_FROM_TENSOR,
              "/get_weights_by_name": SGLANG_GET_WEIGHTS_BY_NAME,
              "/update_weight_version": SGLANG_UPDATE_WEIGHT_VERSION,
              "/pause_generation": SGLANG_PAUSE, "/continue_generation": SGLANG_PAUSE}
    for path, body in sent:
        if path in fields:
            assert set(body) <= fields[path], path
    bodies = dict(sent)
    # http_server.py: update_weight_version keeps new_version as server_args.weight_version (a str)
    assert bodies["/update_weight_version"]["new_version"] == "3"
    assert len(bodies["/update_weights_from_tensor"]["serialized_named_tensors"]) == 1  # one per TP rank


def test_engine_kwargs_are_server_args_and_unknown_ones_are_named():
    ours = {"model_path": "m", "load_format": "dummy", "dtype": "bfloat16", "tp_size": 1, "base_gpu_id": 0,
            "mem_fraction_static": 0.3, "skip_tokenizer_init": True, "random_seed": 0, "context_length": 40,
            "custom_weight_loader": [LOADER_PATH], "log_level": "error", "enable_deterministic_inference": True}
    check_engine_kwargs(ours, SGLANG_SERVER_ARGS, "0.5.9")
    check_engine_kwargs({"no_such_arg": 1}, None)  # names unknown: sglang.Engine decides
    older = SGLANG_SERVER_ARGS - {"enable_deterministic_inference"}
    with pytest.raises(ValueError, match=r"0\.5\.0.*enable_deterministic_inference.*sglang_sampling_seed=false"):
        check_engine_kwargs(ours, older, "0.5.0")
    with pytest.raises(ValueError, match=r"\['attention_backnd'\].*sglang_engine_args"):
        check_engine_kwargs({**ours, "attention_backnd": "triton"}, SGLANG_SERVER_ARGS)
