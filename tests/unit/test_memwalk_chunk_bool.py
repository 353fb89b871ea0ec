"""``PlanConfig.logprob_chunk_tokens`` refuses a bool, as every other integer field does: ``True`` used to be
planned as a chunk of one token (and ``False`` as the unchunked computation) without a word."""

from __future__ import annotations

import pytest

from megatron_logra.memory.plan_config import PlanConfig


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_chunk_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        PlanConfig(logprob_chunk_tokens=value)


@pytest.mark.parametrize("value", [0, 1, 1024])
def test_integer_chunks_are_kept(value):
    assert PlanConfig(logprob_chunk_tokens=value).logprob_chunk_tokens == value
