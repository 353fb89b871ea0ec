"""A Hugging Face ``config.json`` is read as transformers reads it, or refused by field name.

* RoPE base: with both a top-level ``rope_theta`` and ``rope_parameters.rope_theta`` (an edited or
  migrated config), transformers (>= 5) uses ``rope_parameters``; the loader must pick the same value
  for Llama, Qwen2 and Qwen3 (checked against transformers' own config object and, for Llama, its
  forward pass), where it used the stale top-level field.
* Types: a null, string or wrong-type numeric / boolean field (``rms_norm_eps: null``,
  ``tie_word_embeddings: "false"``) is a ``ValueError`` naming the field and the file, exit status 2
  from the CLI, never a traceback and never a truthiness reading ("false" as true).
* ``head_dim``: a Qwen3 config without it gets transformers' default (``Qwen3Config.head_dim`` = 128),
  not hidden / heads: the shapes the loader plans equal those transformers builds.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from megatron_logra.convert import convert_hf_to_mcore, model_config_from_hf
from megatron_logra.convert.cli import main as convert_main
from megatron_logra.convert.tensor_plan import hf_expected_shapes
from megatron_logra.models.presets import load_hf_config, resolve_model

SHAPE = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"llama": (LlamaConfig, "LlamaForCausalLM"), "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
            "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _save(cls, path: Path, **kw):
    """A tiny random HF model of config class ``cls`` saved at ``path`` (config.json + model.safetensors)."""
    config = cls(**SHAPE, **kw)
    config.architectures = [{LlamaConfig: "LlamaForCausalLM", Qwen2Config: "Qwen2ForCausalLM",
                             Qwen3Config: "Qwen3ForCausalLM"}[cls]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
    return path


def _edit(path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    raw = json.loads((path / "config.json").read_text())
    for key in drop:
        raw.pop(key, None)
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _config_dir(tmp_path: Path, family: str, drop: tuple[str, ...] = (), **changes) -> Path:
    """A directory holding only the ``config.json`` transformers writes for ``family``, edited."""
    cls, arch = FAMILIES[family]
    d = tmp_path / family
    d.mkdir(exist_ok=True)
    config = cls(**SHAPE)
    config.architectures = [arch]
    config.to_json_file(d / "config.json")
    return _edit(d, drop, **changes)


# ------------------------------------------------------------------------------------------ RoPE base
ROPE_CASES = {
    "both_differ": dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "top_level_only": dict(rope_theta=500000.0, rope_parameters=None),
    "parameters_without_theta": dict(rope_theta=300000.0, rope_parameters={"rope_type": "default"}),
    "parameters_only": dict(rope_parameters={"rope_type": "default", "rope_theta": 250000.0}),
    "default_rope_scaling_wins": dict(rope_theta=10000.0, rope_scaling={"rope_type": "default", "rope_theta": 40000.0},
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_base_is_the_one_transformers_uses(family, case, tmp_path):
    d = _config_dir(tmp_path, family, drop=("rope_theta", "rope_parameters"), **ROPE_CASES[case])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoConfig.from_pretrained(d).rope_parameters["rope_theta"]
    assert model_config_from_hf(d).rotary_base == theirs  # the converter / model.hf_path path
    assert load_hf_config(d).rotary_base == theirs  # the presets path (--model config.json, memory planner)


def test_two_rope_thetas_give_transformers_logits(tmp_path):
    """A Llama whose config.json holds rope_theta=1e4 and rope_parameters.rope_theta=1e6: transformers' forward
    equals that of the same weights under an unambiguous config holding the base the loader reads."""
    src = _save(LlamaConfig, tmp_path / "two", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    _edit(src, rope_theta=10000.0)
    base = model_config_from_hf(src).rotary_base
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    raw = json.loads((src / "config.json").read_text())
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(base)}
    (plain / "config.json").write_text(json.dumps(raw))
    tokens = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(input_ids=tokens).logits
        ours = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()(input_ids=tokens).logits
    assert torch.equal(ref, ours), f"rotary_base={base}: max |dlogit| {(ref - ours).abs().max().item():.3g}"


def test_nested_rope_parameters_are_refused(tmp_path):
    d = _config_dir(tmp_path, "qwen3", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match=r"rope_parameters is nested per layer type"):
        model_config_from_hf(d)


# ------------------------------------------------------------------------------------------ field types
BAD_FIELDS = [
    ("rms_norm_eps", None), ("rms_norm_eps", "1e-5"), ("rms_norm_eps", True), ("rms_norm_eps", 0),
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", None), ("tie_word_embeddings", 0),
    ("mlp_bias", "false"), ("attention_bias", None),
    ("num_key_value_heads", "2"), ("num_key_value_heads", 2.0),
    ("rope_theta", "1e6"), ("rope_theta", None),
    ("head_dim", "16"), ("max_position_embeddings", "64"), ("max_position_embeddings", None),
    ("use_sliding_window", "false"),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save(LlamaConfig, tmp_path_factory.mktemp("llama") / "hf")


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_wrong_type_field_is_one_error_line_naming_field_and_file(field, value, llama_dir, tmp_path, capsys):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    raw = json.loads((llama_dir / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default"}  # the base then comes from the top-level rope_theta
    raw["rope_theta"] = 10000.0
    raw[field] = value
    (d / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    assert convert_main(["hf-to-mcore", "--hf", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-logra convert hf-to-mcore: error:") and "\n" not in err, err
    assert f"{field}={value!r}" in err and str(d / "config.json") in err, err
    assert not out.exists()
    if field not in ("max_position_embeddings", "use_sliding_window"):  # the presets loader does not read these
        with pytest.raises(ValueError, match=rf"config\.json: {field}="):
            load_hf_config(d / "config.json")


def test_null_kv_heads_is_as_many_as_heads_as_in_transformers(tmp_path):
    d = _config_dir(tmp_path, "llama", num_key_value_heads=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoConfig.from_pretrained(d).num_key_value_heads
    cfg = load_hf_config(d)
    assert (cfg.num_query_groups or cfg.num_attention_heads) == theirs == SHAPE["num_attention_heads"]


# ------------------------------------------------------------------------------------------ head_dim default
def test_qwen3_without_head_dim_gets_transformers_default(tmp_path):
    src = _save(Qwen3Config, tmp_path / "q3")  # head_dim left at Qwen3Config's default
    _edit(src, drop=("head_dim",))
    assert "head_dim" not in json.loads((src / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoConfig.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert theirs.head_dim != SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # the case that matters
    for cfg in (model_config_from_hf(src), load_hf_config(src), resolve_model(str(src / "config.json"))):
        assert cfg.head_dim == theirs.head_dim
    planned = hf_expected_shapes(model_config_from_hf(src))
    built = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert {n: tuple(s) for n, s in planned.items()} == {n: built[n] for n in planned}
    convert_hf_to_mcore(src, tmp_path / "mc")  # every tensor's shape agrees with the plan


def test_null_head_dim_is_refused_for_qwen3(tmp_path):
    d = _config_dir(tmp_path, "qwen3", head_dim=None)
    with pytest.raises(ValueError, match=r"config\.json: head_dim=None"):
        load_hf_config(d)
