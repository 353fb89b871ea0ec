"""``PlanConfig`` refuses values of the wrong type with a ``ValueError`` naming the field, before any
arithmetic: a string engine fraction used to reach ``int('0.3' * gpu_memory_bytes)`` (string repetition)."""

from __future__ import annotations

import pytest

from megatron_logra.memory import PlanConfig, plan
from megatron_logra.memory.units import GiB
from megatron_logra.models.gpt import ModelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=64,
                    seq_length=32, params_dtype="bfloat16")


@pytest.mark.parametrize("field, value", [
    ("engine_fraction", "0.3"), ("engine_fraction", True), ("engine_fraction", None), ("engine_fraction", 1.5),
    ("engine_fraction", float("nan")), ("engine_fraction", [0.3]),
    ("gpu_memory_bytes", "80"), ("gpu_memory_bytes", 80.5 * GiB), ("gpu_memory_bytes", True),
    ("gpu_memory_bytes", None), ("gpu_memory_bytes", 0), ("gpu_memory_bytes", "-1GiB"),
    ("overhead_bytes", "2"), ("overhead_bytes", 2.0), ("overhead_bytes", None), ("overhead_bytes", -1),
    ("freeze_native", "false"), ("cache_projections", 1), ("policy_sync", None), ("reference_model", "yes"),
    ("distributed_optimizer", 0), ("scaled_native_step", "no"),
])
def test_a_wrong_type_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PlanConfig(**{field: value})
    with pytest.raises(ValueError, match=field):  # the same through plan()'s keyword fields, on a small GPU
        plan(MODEL, **{"rank": 8, "seq_len": 32, "gpu_memory_bytes": 12, field: value})


def test_sizes_with_a_unit_are_read_as_bytes_and_fractions_stored_as_floats():
    cfg = PlanConfig(gpu_memory_bytes="80GiB", overhead_bytes="2GiB", engine_fraction=0)
    assert (cfg.gpu_memory_bytes, cfg.overhead_bytes) == (80 * GiB, 2 * GiB)
    assert isinstance(cfg.engine_fraction, float) and cfg.engine_fraction == 0.0
    assert plan(MODEL, rank=8, seq_len=32, gpu_memory_bytes="12GiB", engine_fraction=0.25).worst.engine == 3 * GiB
