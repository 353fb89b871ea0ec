"""``check_hf_config`` refuses a sliding window exactly when transformers would run one.

The oracle is transformers itself. Each case is a ``config.json`` dict of a tiny model (2 layers, window 4
where a window is set). Transformers builds it with the family's own config class (``from_dict``, as
``from_pretrained`` does). Its logits on 12 tokens are then compared with the logits of the same weights
under that family's explicit full-attention config. Equal logits mean every layer attends to all
positions, and the config must be accepted. Different logits mean some layer is windowed, and the
config must be refused with the field named. The check is made for a run of ``model.seq_length`` 12 (the
tokens compared): a window no such sequence reaches past (Mistral's default 4096 when the key is missing)
computes the full-attention model, and is accepted; a longer run with that window is refused.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.utils._device

torch.utils._device._device_constructors()  # before megatron_logra.cpu_shim (see test_convert.py)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from megatron_logra.convert.hf_checks import check_hf_config  # noqa: E402
from megatron_logra.convert.hf_config import model_config_from_hf_dict_strict  # noqa: E402

FAMILIES = {"llama": (LlamaConfig, "LlamaForCausalLM"), "mistral": (MistralConfig, "MistralForCausalLM"),
            "qwen2": (Qwen2Config, "Qwen2ForCausalLM"), "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
WINDOW_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
T = 12  # tokens: three times the window of 4
FULL = ["full_attention", "full_attention"]

CASES = [  # (family, window fields written to config.json; absent keys are left out)
    ("mistral", dict()),                                           # MistralConfig's default window 4096
    ("mistral", dict(sliding_window=4)),
    ("mistral", dict(use_sliding_window=False, sliding_window=4)),  # Mistral has no such switch
    ("mistral", dict(sliding_window=None)),
    ("mistral", dict(use_sliding_window=True, sliding_window=None)),
    ("qwen2", dict(sliding_window=4)),                             # use_sliding_window defaults to false
    ("qwen2", dict(use_sliding_window=False, sliding_window=4, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),  # layers >= 2 slide: none
    ("qwen2", dict(use_sliding_window=True, sliding_window=4)),     # max_window_layers defaults to 28
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=None, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0, layer_types=FULL)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=5)),
    ("qwen3", dict(sliding_window=4, max_window_layers=0)),
    ("llama", dict(sliding_window=4)),                             # no such field in Llama
    ("llama", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
]


def _raw(family: str, window_fields: dict) -> dict:
    cls, arch = FAMILIES[family]
    raw = cls(**COMMON).to_dict()
    for key in WINDOW_KEYS:
        raw.pop(key, None)
    raw.update(window_fields, architectures=[arch])
    return raw


def _full_attention_raw(family: str) -> dict:
    return _raw(family, {"mistral": dict(sliding_window=None), "qwen2": dict(use_sliding_window=False),
                         "qwen3": dict(use_sliding_window=False), "llama": dict()}[family])


def _logits(raw: dict, state: dict | None = None):
    cls, _ = FAMILIES[raw["model_type"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cls.from_dict(dict(raw))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    tokens = torch.arange(T).reshape(1, T) * 5 % COMMON["vocab_size"]
    with torch.no_grad():
        return model(input_ids=tokens).logits, model.state_dict(), config


def transformers_windows(raw: dict) -> bool:
    """Whether transformers runs some layer of ``raw`` with a sliding window (see the module docstring)."""
    family = raw["model_type"]
    full, state, _ = _logits(_full_attention_raw(family))
    got, _, config = _logits(raw, state)
    diff = (got - full).abs().max().item()
    assert diff < 1e-5 or diff > 1e-2, f"ambiguous oracle: max |dlogit| {diff}"
    return diff > 1e-2


def _ours(raw: dict, seq_length: int = T):
    try:
        model_config_from_hf_dict_strict(dict(raw), seq_length=seq_length)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("family, fields", CASES, ids=[f"{f}-{sorted(kw.items())}" for f, kw in CASES])
def test_a_sliding_window_is_refused_exactly_when_transformers_runs_one(family, fields):
    raw = _raw(family, fields)
    windowed = transformers_windows(raw)
    refusal = _ours(raw)
    if windowed:
        assert refusal is not None, f"{family} {fields}: transformers slides a window but the config was accepted"
        assert "sliding_window=" in refusal and "not supported" in refusal, refusal
    else:
        assert refusal is None, f"{family} {fields}: transformers runs full attention but: {refusal}"


def test_the_oracle_sees_the_cases_it_must():
    """Both outcomes occur for Mistral and Qwen, so the parametrised test checks both directions."""
    seen = {(f, transformers_windows(_raw(f, kw))) for f, kw in CASES}
    assert {("mistral", True), ("mistral", False), ("qwen2", True), ("qwen2", False), ("qwen3", True),
            ("qwen3", False), ("llama", False)} <= seen


def test_mistral_refusals_say_why():
    msg = _ours(_raw("mistral", {}), seq_length=4097)
    assert "sliding_window=4096 (the key is missing: MistralConfig's default) is not supported" in msg, msg
    assert "model.seq_length is at most 4096" in msg and "this one has model.seq_length=4097" in msg, msg
    msg = _ours(_raw("mistral", dict(use_sliding_window=False, sliding_window=4)))
    assert "whatever use_sliding_window says" in msg and '"sliding_window": null' in msg, msg


@pytest.mark.parametrize("family, fields", [("mistral", dict(sliding_window=8)),
                                            ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                                           max_window_layers=0))])
def test_a_window_no_sequence_reaches_past_is_accepted_up_to_its_width(family, fields):
    """Mistral-7B-v0.1's ``sliding_window: 4096`` in small: accepted for runs of at most the window (the
    transformers model equals its full-attention self on every such sequence, checked at T = 12 >= 8 above
    and here at 8 tokens), refused one token later."""
    raw = _raw(family, fields)
    full, state, _ = _logits(_full_attention_raw(family))
    got, _, _ = _logits(raw, state)
    assert (got[:, :8] - full[:, :8]).abs().max() < 1e-5 < (got - full).abs().max()  # causal: a prefix of 8
    assert _ours(raw, seq_length=8) is None
    assert "not supported" in _ours(raw, seq_length=9)


def test_the_run_seq_length_decides_for_a_checkpoint_directory(tmp_path):
    """``model.hf_path`` with a windowed config: the run's ``model.seq_length`` (the base config's) decides."""
    import json

    from megatron_logra.convert import model_config_from_hf
    from megatron_logra.models.gpt import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(_raw("mistral", {})))  # MistralConfig's default 4096
    assert model_config_from_hf(tmp_path, base=ModelConfig(seq_length=4096)).seq_length == 4096
    with pytest.raises(ValueError, match=r"sliding_window=4096 .*this one has model.seq_length=8192"):
        model_config_from_hf(tmp_path, base=ModelConfig(seq_length=8192))


def test_qwen_refusal_names_the_windowed_layers():
    msg = _ours(_raw("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)))
    assert "use_sliding_window=True with sliding_window=4 and max_window_layers=1 gives layers 1..1" in msg, msg


@pytest.mark.parametrize("value", ["28", -1, True, None])
def test_a_bad_max_window_layers_is_named(value):
    raw = _raw("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=value))
    with pytest.raises(ValueError, match=rf"max_window_layers={value!r} must be a non-negative integer"):
        check_hf_config(raw)


def test_stray_llama_window_keys_are_ignored_with_a_warning(caplog):
    raw = _raw("llama", dict(use_sliding_window=True, sliding_window=4))
    with caplog.at_level(logging.WARNING, logger="megatron_logra.convert.hf_checks"):
        cfg = model_config_from_hf_dict_strict(raw)
    assert cfg.num_layers == 2
    assert "use_sliding_window=True" in caplog.text and "sliding_window=4" in caplog.text
    assert "ignored" in caplog.text, caplog.text


def test_use_sliding_window_must_be_a_boolean_in_every_family():
    for family in FAMILIES:
        with pytest.raises(ValueError, match=r"use_sliding_window='false'"):
            check_hf_config(_raw(family, dict(use_sliding_window="false", sliding_window=None)))
