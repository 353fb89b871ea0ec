"""``rl.rollout.eval_max_new_tokens`` (slime's ``--eval-max-response-len``): the held-out evaluation's own
completion length cap. 0 (the default) is ``rl.rollout.max_new_tokens``; anything but an int >= 0 is refused naming
the field; a saved config written before the field existed reads as 0."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.config import RolloutConfig
from megatron_logra.rl.rollout_config import eval_new_tokens, new_tokens_limit


@pytest.mark.parametrize("value", [-1, 1.5, True, "8", None])
def test_anything_but_an_int_of_zero_or_more_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^rl\.rollout\.eval_max_new_tokens=.* must be an int >= 0 "
                                         r"\(0 = rl\.rollout\.max_new_tokens\)"):
        RolloutConfig(eval_max_new_tokens=value)


@pytest.mark.parametrize("value", ["-3", "2.5", "many"])
def test_a_bad_override_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"rl\.rollout\.eval_max_new_tokens="):
        parse_args_to_config("tiny", [f"rl.rollout.eval_max_new_tokens={value}"])


def test_zero_is_the_training_cap_and_a_value_is_the_evaluations_own():
    plain = parse_args_to_config("tiny", ["rl.rollout.max_new_tokens=6"]).rl.rollout
    assert plain.eval_max_new_tokens == 0 and eval_new_tokens(plain) == 6
    assert new_tokens_limit(plain) == new_tokens_limit(plain, held_out=True) == (6, "rl.rollout.max_new_tokens")
    longer = parse_args_to_config("tiny", ["rl.rollout.max_new_tokens=6",
                                           "rl.rollout.eval_max_new_tokens=16"]).rl.rollout
    assert eval_new_tokens(longer) == 16
    assert new_tokens_limit(longer) == (6, "rl.rollout.max_new_tokens")  # training keeps its own cap
    assert new_tokens_limit(longer, held_out=True) == (16, "rl.rollout.eval_max_new_tokens")
    shorter = RolloutConfig(max_new_tokens=8, eval_max_new_tokens=3)  # evaluating shorter answers is allowed too
    assert eval_new_tokens(shorter) == 3


def test_a_saved_config_without_the_field_reads_as_the_training_cap():
    from megatron_logra.config import RunConfig, from_dict, to_dict

    saved = to_dict(parse_args_to_config("tiny", []))
    del saved["rl"]["rollout"]["eval_max_new_tokens"]
    rollout = from_dict(RunConfig, saved).rl.rollout
    assert rollout.eval_max_new_tokens == 0 and eval_new_tokens(rollout) == rollout.max_new_tokens
