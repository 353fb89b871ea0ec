"""A Hugging Face config.json is read with transformers' own defaults: a missing ``num_key_value_heads`` is the
family's config-class default (not the head count), and bias fields a family's model does not read (Mistral's
``attention_bias`` / ``mlp_bias``) change nothing. Checked against transformers' config classes and models."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_logra.convert import load_hf_into_model, model_config_from_hf
from megatron_logra.models.gpt import ModelConfig, build_gpt
from megatron_logra.models.presets import model_config_from_hf_dict

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, rms_norm_eps=1e-5,
             max_position_embeddings=64)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _raw(model_type: str, **fields) -> dict:
    return {"architectures": [ARCH[model_type]], "model_type": model_type, **SHAPE, **fields}


def _transformers_kv_heads(raw: dict) -> int:
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    return AutoConfig.for_model(raw["model_type"], **fields).num_key_value_heads


@pytest.mark.parametrize("model_type,heads", [("llama", 4), ("mistral", 16), ("qwen2", 32), ("qwen3", 64),
                                              ("qwen3", 4)])
def test_missing_kv_heads_is_the_config_class_default(model_type, heads):
    raw = _raw(model_type, num_attention_heads=heads, **({"head_dim": 16} if model_type == "qwen3" else {}))
    want = _transformers_kv_heads(raw)
    if heads % want:  # transformers' default does not divide the heads: neither can build the model
        with pytest.raises(ValueError, match=r"num_key_value_heads=.*default for qwen3.*give num_key_value_heads"):
            model_config_from_hf_dict(raw)
        return
    cfg = model_config_from_hf_dict(raw)
    assert (cfg.num_query_groups or cfg.num_attention_heads) == want


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_null_kv_heads_is_the_head_count(model_type):
    raw = _raw(model_type, num_attention_heads=8, num_key_value_heads=None)
    cfg = model_config_from_hf_dict(raw)
    assert (cfg.num_query_groups or cfg.num_attention_heads) == _transformers_kv_heads(raw) == 8


def test_null_kv_heads_in_a_mistral_config_is_refused_as_transformers_does():
    raw = _raw("mistral", num_attention_heads=8, num_key_value_heads=None)
    with pytest.raises(Exception):
        _transformers_kv_heads(raw)
    with pytest.raises(ValueError, match="num_key_value_heads=None"):
        model_config_from_hf_dict(raw)


def test_mistral_bias_fields_are_ignored_as_transformers_ignores_them(tmp_path, groups, caplog):
    """A Mistral config.json with ``attention_bias`` / ``mlp_bias`` true: transformers builds its model without
    biases, so the trainer must too, and its logits equal transformers'."""
    raw = _raw("mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
               tie_word_embeddings=False, attention_bias=True, mlp_bias=True, torch_dtype="float32")
    config = AutoConfig.for_model("mistral", **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config.architectures = raw["architectures"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert not any(name.endswith("bias") for name, _ in hf.named_parameters())
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.copy_((0.3 if p.dim() == 1 else 0.15) * torch.randn(p.shape, generator=gen) + (p.dim() == 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.update(attention_bias=True, mlp_bias=True)  # as such a checkpoint ships them
    (tmp_path / "config.json").write_text(json.dumps(saved))

    with caplog.at_level("WARNING"):
        cfg = model_config_from_hf(tmp_path, base=ModelConfig(seq_length=32, params_dtype="float32"))
    assert not cfg.add_bias_linear and not cfg.add_qkv_bias
    assert "attention_bias=True, mlp_bias=True ignored" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(cfg, groups, seed=1).eval()
    load_hf_into_model(model, groups, tmp_path, cfg)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
        out = model(tokens, torch.arange(11)[None].expand_as(tokens), None)[..., :64]
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
