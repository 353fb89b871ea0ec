"""The SGLang engine sends the stop tokens and stop strings in its ``/generate`` sampling params (against the CPU
stand-in of SGLang), and a rollout a stop string ended keeps its tokens and is finished."""

from __future__ import annotations

import json

from megatron_logra.rollout.engine import SamplingParams
from megatron_logra.rollout.sglang_api import build_generate_payload, parse_generate_response
from megatron_logra.rollout.sglang_engine import SGLangEngine
from tests.support.sglang_stand_ins import PADDED, VOCAB, FakeSGLang, FakeTarget


def _engine(fake) -> SGLangEngine:
    return SGLangEngine(generate_fn=fake, target=FakeTarget(), vocab_size=VOCAB, padded_vocab_size=PADDED)


def test_the_request_carries_stop_token_ids_and_stop_strings():
    fake = FakeSGLang(seed=3)
    params = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=[2, 31, 2], stop=["</answer>", "\n\n"],
                            seed=5)
    out = _engine(fake).generate([[1, 2, 3], [4]], params)
    assert len(out) == 2
    sp = fake.payloads[-1]["sampling_params"]
    assert sp["stop_token_ids"] == [2, 31]
    assert sp["stop"] == ["</answer>", "\n\n"] and sp["no_stop_trim"] is True  # the text keeps the string
    json.dumps(fake.payloads[-1])


def test_without_stop_strings_the_request_is_as_before():
    plain = build_generate_payload([[1]], SamplingParams(stop_token_ids=[2]), vocab_size=VOCAB,
                                   padded_vocab_size=PADDED)
    assert "stop" not in plain["sampling_params"] and "no_stop_trim" not in plain["sampling_params"]
    seeded = build_generate_payload([[1], [2]], SamplingParams(stop=["x"]), vocab_size=VOCAB, padded_vocab_size=PADDED,
                                    send_seed=True)
    assert all(sp["stop"] == ["x"] for sp in seeded["sampling_params"])  # every request's own params


def test_a_rollout_a_stop_string_ended_keeps_its_tokens_and_is_finished():
    # SGLang ends at the token completing the string: output_ids and their log-probs keep it
    answer = {"output_ids": [17, 4], "meta_info": {"finish_reason": {"type": "stop", "matched": "</answer>"},
                                                   "output_token_logprobs": [[-0.5, 17, None], [-0.25, 4, None]]}}
    (r,) = parse_generate_response([answer], [[1, 2]], weight_version=0, stop_token_ids=[2])
    assert r.completion_ids == [17, 4] and r.logprobs == [-0.5, -0.25] and r.finished
