"""``ModelConfig`` and ``ParallelConfig`` refuse values that would run to a NaN loss with exit 0 or crash
with a raw torch/Python traceback, naming the field: a RoPE base or norm epsilon <= 0 (NaN on the first
forward), a vocabulary padding multiple of 0 (ZeroDivisionError), an init std <= 0 (torch's "normal expects
std >= 0.0", or at 0 all-zero weights with zero gradients: a run that never trains), a dropout probability
outside [0, 1), NaN/inf in any float field, a non-positive number of KV groups, and a collective timeout
below one minute. Configs are constructed directly (no model is built)."""

from __future__ import annotations

import copy
import dataclasses
import datetime

import pytest

from megatron_logra.config import RECIPES, load_recipe
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.presets import PRESETS
from megatron_logra.parallel import ParallelConfig

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value, message", [
    ("rotary_base", 0, r"model\.rotary_base=0 must be a finite number > 0"),
    ("rotary_base", -10000, r"model\.rotary_base=-10000 must be a finite number > 0"),
    ("rotary_base", NAN, r"model\.rotary_base=nan must be a finite number > 0"),
    ("rotary_base", INF, r"model\.rotary_base=inf must be a finite number > 0"),
    ("layernorm_epsilon", -1.0, r"model\.layernorm_epsilon=-1\.0 must be a finite number > 0"),
    ("layernorm_epsilon", 0.0, r"model\.layernorm_epsilon=0\.0 must be a finite number > 0"),
    ("layernorm_epsilon", NAN, r"model\.layernorm_epsilon=nan must be a finite number > 0"),
    ("layernorm_epsilon", INF, r"model\.layernorm_epsilon=inf must be a finite number > 0"),
    ("init_std", -1.0, r"model\.init_std=-1\.0 must be a finite number > 0"),
    ("init_std", 0.0, r"model\.init_std=0\.0 must be a finite number > 0"),
    ("init_std", NAN, r"model\.init_std=nan must be a finite number > 0"),
    ("init_std", INF, r"model\.init_std=inf must be a finite number > 0"),
    ("make_vocab_size_divisible_by", 0, r"model\.make_vocab_size_divisible_by=0 must be >= 1"),
    ("make_vocab_size_divisible_by", -16, r"model\.make_vocab_size_divisible_by=-16 must be >= 1"),
    ("num_query_groups", 0, r"model\.num_query_groups=0 must be a positive integer"),
    ("num_query_groups", -2, r"model\.num_query_groups=-2 must be a positive integer"),
])
def test_bad_model_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("field", ["hidden_dropout", "attention_dropout"])
@pytest.mark.parametrize("value", [1.5, 1.0, -0.1, NAN, INF, -INF])
def test_dropout_must_be_a_probability_below_one(field, value):
    with pytest.raises(ValueError, match=rf"^model\.{field}=\S+ must be a dropout probability in \[0, 1\)"):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("values", [
    dict(hidden_dropout=0.0, attention_dropout=0.99, make_vocab_size_divisible_by=1, rotary_base=1,
         layernorm_epsilon=1e-12, init_std=1e-6, num_query_groups=1),
    dict(hidden_dropout=0.1, attention_dropout=0.1, num_query_groups=2, rotary_base=1000000),
])
def test_boundary_model_values_are_accepted_unchanged(values):
    cfg = ModelConfig(**values)
    held = {k: getattr(cfg, k) for k in values}
    assert held == values and all(type(held[k]) is type(v) for k, v in values.items()), held
    if values.get("make_vocab_size_divisible_by") == 1:
        assert cfg.padded_vocab_size() == cfg.vocab_size


def test_every_shipped_recipe_and_preset_validates_unchanged():
    """Validation accepts every shipped config as it is: it neither raises nor rewrites a field."""
    for name, factory in RECIPES.items():
        cfg = factory()
        before = copy.deepcopy(cfg)
        assert cfg.validate() is cfg and cfg == before, name
    for name, factory in PRESETS.items():
        cfg = factory()
        assert isinstance(cfg, ModelConfig) and dataclasses.replace(cfg) == cfg, name  # __post_init__ again
    tiny = load_recipe("tiny")
    assert tiny.validate() == RECIPES["tiny"]()


def test_hf_derived_model_configs_validate():
    from megatron_logra.models.presets import model_config_from_hf_dict

    raw = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 192,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": False}
    cfg = model_config_from_hf_dict(raw)
    assert cfg.rotary_base == 1000000 and cfg.num_query_groups == 2 and cfg.layernorm_epsilon == 1e-6


@pytest.mark.parametrize("value", [0, -1, NAN, INF, -INF, 0.5, 10**13])
def test_parallel_timeout_must_be_finite_and_at_least_one_minute(value):
    with pytest.raises(ValueError, match=r"^parallel\.timeout_minutes=\S+ must be a finite number of minutes from 1 "):
        ParallelConfig(timeout_minutes=value)


def test_parallel_timeout_accepts_its_range():
    from megatron_logra.parallel import _MAX_TIMEOUT_MINUTES

    for value in (1, 30, 1.5, _MAX_TIMEOUT_MINUTES):
        held = ParallelConfig(timeout_minutes=value).timeout_minutes
        assert held == value and type(held) is type(value), (value, held)  # neither clamped nor rounded
        assert datetime.timedelta(minutes=held).total_seconds() == 60 * value  # what the process groups get
