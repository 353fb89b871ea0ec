"""The checkpoint dtype of a ``config.json`` is read as transformers (>= 5) reads it: ``dtype`` when given,
``torch_dtype`` (its older name) only without it. A config that carries both with different values (one
rewritten by transformers 5, the other left from before) used to give the older ``torch_dtype``: the dtype
``hf-to-mcore`` records and ``megatron-logra memory --model DIR`` plans with. A bad value names the field it
came from."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from megatron_logra.models.presets import load_hf_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 160,
         "max_position_embeddings": 256}


def _dir(tmp_path, **fields):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return d


@pytest.mark.parametrize("fields", [dict(dtype="bfloat16", torch_dtype="float32"),
                                    dict(dtype="float16", torch_dtype="bfloat16"),
                                    dict(torch_dtype="float16"), dict(dtype="float32"),
                                    dict(dtype=None, torch_dtype="float16")])
def test_the_dtype_is_transformers_choice(fields, tmp_path):
    d = _dir(tmp_path, **fields)
    want = AutoConfig.from_pretrained(d).dtype
    assert isinstance(want, torch.dtype)
    assert load_hf_config(d).torch_dtype == want
    assert load_hf_config(d, strict=True).torch_dtype == want


def test_a_bad_dtype_names_its_field(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: dtype='int8': choose bfloat16, float16 or float32"):
        load_hf_config(_dir(tmp_path, dtype="int8", torch_dtype="float32"))
