"""``SamplingParams`` input types: any integral / real number type is accepted (numpy's included, bools not)
and stored as a Python number; a value of the wrong kind is a ``ValueError`` naming ``sampling.<field>``,
never a bare ``TypeError``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_logra.rollout.engine import SamplingParams
from megatron_logra.rollout.sglang_api import build_generate_payload


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_new_tokens=np.int64(4),
                            stop_token_ids=np.array([2, 3]), seed=np.int64(3))
    assert (params.temperature, params.top_p, params.max_new_tokens, params.stop_token_ids, params.seed) == \
        (0.5, pytest.approx(0.9), 4, [2, 3], 3)
    assert type(params.max_new_tokens) is int and type(params.seed) is int and type(params.temperature) is float
    assert all(type(t) is int for t in params.stop_token_ids)
    assert SamplingParams(stop_token_ids=(5, np.int32(6)), seed=torch.tensor(2).item()).stop_token_ids == [5, 6]
    # what the engines do with them: a torch generator seed and a JSON payload
    torch.Generator().manual_seed(params.seed)
    build_generate_payload([[1]], params, vocab_size=8, padded_vocab_size=8, send_seed=True)


@pytest.mark.parametrize("kw, field", [
    (dict(stop_token_ids=None), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(seed=None), "seed"),
    (dict(seed=3.0), "seed"),
    (dict(seed=np.bool_(True)), "seed"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens="4"), "max_new_tokens"),
    (dict(temperature="1"), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_p=False), "top_p"),
])
def test_wrong_kinds_of_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"sampling\.{field}="):
        SamplingParams(**kw)
