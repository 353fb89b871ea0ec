"""Stop strings (``rl.rollout.stop``) on the in-process SGLang engine.

SGLang matches a stop string on its own decoding of the completion's last tokens, with the tokenizer it loaded
at start. The in-process engine starts with ``skip_tokenizer_init=True`` from a directory holding only
``config.json`` (``rollout.sglang_launch``): it has no tokenizer, and SGLang then refuses every request with stop
strings (``raise_if_tokenizer_required``; older releases fail in the scheduler on ``None.decode``) after the whole
run was built. Such a config is refused when it is read, naming the field, the slime flag and the fixes; a server
(``rl.rollout.sglang_url``), the embedded engine, or engine arguments that load a tokenizer are accepted.
"""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.config import RolloutConfig


def test_the_in_process_engine_without_a_tokenizer_refuses_stop_strings():
    with pytest.raises(ValueError, match=r"rl\.rollout\.stop.*--rollout-stop.*tokenizer.*stop_token_ids"):
        RolloutConfig(engine="sglang", stop=["</answer>"])
    with pytest.raises(ValueError, match=r"rl\.rollout\.stop"):  # an explicit skip_tokenizer_init=true alike
        RolloutConfig(engine="sglang", stop=["</answer>"], sglang_engine_args={"skip_tokenizer_init": True,
                                                                                 "tokenizer_path": "/tok"})
    with pytest.raises(ValueError, match=r"rl\.rollout\.stop"):  # no tokenizer to load: model_path has none
        RolloutConfig(engine="sglang", stop=["</answer>"], sglang_engine_args={"skip_tokenizer_init": False})


@pytest.mark.parametrize("order", [0, 1])
def test_the_command_line_is_refused_in_any_order(order):
    parts = [["rl.rollout.engine=sglang", "model.params_dtype=bfloat16"], ["--rollout-stop", "</answer>"]]
    args = parts[order] + parts[1 - order]
    with pytest.raises(ValueError, match=r"rl\.rollout\.stop.*--rollout-stop"):
        parse_args_to_config("tiny", args)


def test_what_can_match_stop_strings_is_accepted():
    assert RolloutConfig(engine="embedded", stop=["</answer>"]).stop == ["</answer>"]
    assert RolloutConfig(engine="sglang", sglang_url="http://host:30000", stop=["</answer>"]).stop == ["</answer>"]
    loads = RolloutConfig(engine="sglang", stop=["</answer>"],
                          sglang_engine_args={"skip_tokenizer_init": False, "tokenizer_path": "/ckpt"})
    assert loads.stop == ["</answer>"]
    # stop token ids need no tokenizer: SGLang compares ids
    assert RolloutConfig(engine="sglang", stop_token_ids=[151645]).stop_token_ids == [151645]
