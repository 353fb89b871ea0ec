"""``rl.rollout.stop_token_ids`` / ``rl.rollout.stop``: their checks, slime's ``--rollout-stop-token-ids`` and
``--rollout-stop`` (nargs lists), the build-time vocabulary check, ``SamplingParams.stop`` and the tail window of
:class:`~megatron_logra.rollout.stop_strings.StopStrings`."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.config import RolloutConfig
from megatron_logra.rollout.engine import SamplingParams
from megatron_logra.rollout.stop_strings import StopStrings


def test_defaults_are_empty_and_values_are_checked():
    assert RolloutConfig().stop_token_ids == [] and RolloutConfig().stop == []
    ok = RolloutConfig(stop_token_ids=(151645, 151643), stop=("</answer>", " Q:"))
    assert ok.stop_token_ids == [151645, 151643] and ok.stop == ["</answer>", " Q:"]
    for bad in ([-1], [True], ["7"], [1.5], 7):
        with pytest.raises(ValueError, match=r"rl\.rollout\.stop_token_ids"):
            RolloutConfig(stop_token_ids=bad)
    for bad in ([""], ["a", ""], [3], "abc"):
        with pytest.raises(ValueError, match=r"rl\.rollout\.stop=.*non-empty strings"):
            RolloutConfig(stop=bad)


def test_slime_flags_take_several_values():
    cfg = parse_args_to_config("tiny", ["--rollout-stop-token-ids", "151645", "151643", "--rollout-stop", "</answer>",
                                        "a, b", " Q:", "rl.steps=3", "--rollout-max-response-len", "5"])
    assert cfg.rl.rollout.stop_token_ids == [151645, 151643]
    assert cfg.rl.rollout.stop == ["</answer>", "a, b", " Q:"]  # each word verbatim: commas and spaces kept
    assert cfg.rl.steps == 3 and cfg.rl.rollout.max_new_tokens == 5  # the list ended at key=value / --flag
    one = parse_args_to_config("tiny", ["--rollout-stop", "\n", "--rollout-stop-token-ids", "7"])
    assert one.rl.rollout.stop == ["\n"] and one.rl.rollout.stop_token_ids == [7]
    joined = parse_args_to_config("tiny", ["--rollout-stop-token-ids=5,6", "rl.rollout.stop=[x, y]"])
    assert joined.rl.rollout.stop_token_ids == [5, 6] and joined.rl.rollout.stop == ["x", "y"]
    with pytest.raises(ValueError, match=r"--rollout-stop-token-ids 7 abc.*not an integer"):
        parse_args_to_config("tiny", ["--rollout-stop-token-ids", "7", "abc"])
    with pytest.raises(ValueError, match=r"'1' follows --profile-ranks 0"):  # Megatron-LM's list flags: one value
        parse_args_to_config("tiny", ["--profile-ranks", "0", "1"])


def test_stop_ids_outside_the_vocabulary_are_refused_when_the_run_is_built(tmp_path):
    from megatron_logra.rl.task_setup import task_and_tokenizer

    cfg = parse_args_to_config("tiny", ["--rollout-stop-token-ids", "9", "150", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"rl\.rollout\.stop_token_ids has \[150\], outside the tokenizer"):
        task_and_tokenizer(cfg, tmp_path / "run", will_save=False)
    cfg.rl.rollout.stop_token_ids = [9, 2]
    _, tok, stops = task_and_tokenizer(cfg, tmp_path / "run", will_save=False)
    assert stops == sorted({tok.eos_token_id, 9, 2})


def test_sampling_params_stop():
    assert SamplingParams().stop == [] and SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    for bad in ("abc", [""], [None], 5):
        with pytest.raises(ValueError, match=r"sampling\.stop="):
            SamplingParams(stop=bad)


class _Bytes:
    """A byte-level tokenizer stand-in: token ``i`` is the byte ``i`` (a character of several UTF-8 bytes spans
    several tokens, each decoding alone to U+FFFD); id 256 is a special token, skipped."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def decode(self, ids, skip_special_tokens=False):
        self.calls.append(list(ids))
        return bytes(i for i in ids if i < 256 or not skip_special_tokens).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_the_tail_window_covers_a_stop_string_of_multi_byte_characters():
    tok = _Bytes()
    strings = StopStrings(["éé"], tok)  # 2 characters, 4 bytes: 4 tokens here
    assert strings.window == 5
    ids = encode("abc éx") + encode("éé")
    ends = [j + 1 for j in range(len(ids)) if strings.ends(ids[: j + 1])]
    assert ends == [len(ids)]  # only the last byte completes it (the lone "é" before does not)
    assert all(len(call) <= strings.window for call in tok.calls)  # the tail only, never the whole completion
    assert StopStrings(["x"], tok).ends(encode("ax") + [256])  # a skipped special token after it: still matched
    with pytest.raises(ValueError, match=r"rl\.rollout\.stop.*tokenizer"):
        StopStrings(["x"], None)
