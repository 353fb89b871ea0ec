"""Validation of the RL job's settings (megatron_logra.rl.config): values that would silently train
nothing or fail late are refused when the config is built, naming the field and the fix."""

from __future__ import annotations

import re

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rl.advantages import AdvantageConfig
from megatron_logra.rl.config import RLConfig, RolloutConfig, SFTConfig
from megatron_logra.rl.losses import LossConfig

NAN, INF = float("nan"), float("inf")


def test_grpo_with_groups_of_one_is_refused():
    with pytest.raises(ValueError, match=r"rl\.group_size=1 .*grpo.*rl\.group_size >= 2 or "
                                         r"rl\.advantage\.estimator=reinforce"):
        RLConfig(group_size=1)
    RLConfig(group_size=2)
    RLConfig(group_size=1, advantage=AdvantageConfig(estimator="reinforce"))  # an EMA baseline needs no group


def test_grpo_with_groups_of_one_is_refused_after_overrides():
    with pytest.raises(ValueError, match=r"rl\.group_size=1 "):
        parse_args_to_config("tiny", ["rl.group_size=1"])
    cfg = parse_args_to_config("tiny", ["rl.group_size=1", "rl.advantage.estimator=reinforce"])
    assert cfg.rl.group_size == 1


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field, build", [
    ("rl.rollout.temperature", lambda v: RolloutConfig(temperature=v)),
    ("rl.rollout.eval_temperature", lambda v: RolloutConfig(eval_temperature=v)),
    ("rl.rollout.top_p", lambda v: RolloutConfig(top_p=v)),
    ("rl.rollout.sglang_timeout", lambda v: RolloutConfig(sglang_timeout=v)),
    ("rl.loss.kl_coef", lambda v: RLConfig(loss=LossConfig(kl_coef=v))),
    ("rl.loss.tis_cap", lambda v: RLConfig(loss=LossConfig(tis_cap=v))),
    ("rl.loss.clip_high", lambda v: RLConfig(loss=LossConfig(clip_high=v))),
    ("rl.advantage.eps", lambda v: RLConfig(advantage=AdvantageConfig(eps=v))),
    ("rl.advantage.baseline_weight", lambda v: RLConfig(advantage=AdvantageConfig(baseline_weight=v))),
    ("sft.lr", lambda v: SFTConfig(lr=v)),
])
def test_non_finite_floats_are_refused(field, build, value):
    with pytest.raises(ValueError, match=re.escape(field)):  # a range check of the field may answer first
        build(value)


@pytest.mark.parametrize("override", ["rl.loss.kl_coef=nan", "rl.advantage.eps=inf", "rl.rollout.temperature=nan",
                                      "rl.rollout.eval_temperature=inf", "rl.loss.tis_cap=nan"])
def test_non_finite_overrides_are_refused(override):
    field = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}=.* must be a finite number"):
        parse_args_to_config("tiny", [override])


MATH_TEMPLATE = "{prompt}\nPut your final answer within \\boxed{}."


class _CodePoints:
    """A tokenizer stand-in: one id per character (its code point), no BOS; decoding is exact."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}


def test_prompt_template_with_literal_braces_is_applied():
    from megatron_logra.rl.loop import rl_prompt_ids

    cfg = parse_args_to_config("tiny", [f"rl.prompt_template={MATH_TEMPLATE}"])
    assert cfg.rl.prompt_template == MATH_TEMPLATE
    ids = rl_prompt_ids(_CodePoints(), cfg.rl, "What is {x} if x=2?")  # braces in the problem text stay too
    assert "".join(map(chr, ids)) == "What is {x} if x=2?\nPut your final answer within \\boxed{}."


@pytest.mark.parametrize("template", ["Solve: {problem}", "{}", "Answer {0}", ""])
def test_prompt_template_without_the_prompt_field_is_refused(template):
    with pytest.raises(ValueError, match=r"rl\.prompt_template=.* must contain \{prompt\}.*add it"):
        RLConfig(prompt_template=template)


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("cls, section, field", [
    (LossConfig, "rl.loss", "tis_cap"),
    (LossConfig, "rl.loss", "clip_low"),
    (LossConfig, "rl.loss", "clip_high"),
    (LossConfig, "rl.loss", "kl_coef"),
    (AdvantageConfig, "rl.advantage", "eps"),
    (AdvantageConfig, "rl.advantage", "baseline_weight"),
])
def test_loss_and_advantage_configs_refuse_non_finite_floats_on_their_own(cls, section, field, value):
    # constructed standalone (not inside an RLConfig): nan passed their range checks (kl_coef=nan, tis_cap=nan,
    # eps=nan were accepted)
    with pytest.raises(ValueError, match=rf"^{re.escape(section)}\.{field}=(nan|inf|-inf) must be a finite number"):
        cls(**{field: value})


def test_loss_clip_range_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^rl\.loss\.clip_low=1\.0 must lie in \[0, 1\)$"):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match=r"^rl\.loss\.clip_high=-0\.1 must be >= 0$"):
        LossConfig(clip_high=-0.1)
    LossConfig(clip_low=0.0, clip_high=0.0, kl_coef=0.0)
    AdvantageConfig(eps=0.0, baseline_weight=1.0)
