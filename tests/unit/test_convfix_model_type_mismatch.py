"""A ``config.json`` whose ``model_type`` names another family than its ``architectures`` is refused.

transformers' ``AutoModelForCausalLM`` builds the class of ``model_type`` and ignores ``architectures``;
serving stacks build the class ``architectures`` names. The loader used to take the family from
``architectures`` alone, so ``{"architectures": ["LlamaForCausalLM"], "model_type": "gemma"}`` was converted
and trained as a Llama while transformers loads the same directory as a Gemma (another norm, activation and
embedding scale: other logits). Now ``hf-to-mcore``, ``config`` / ``train --model.hf_path`` and the memory
planner refuse it, naming both fields and the ``model_type`` that matches, before anything is written."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from megatron_logra.cli import main as cli_main
from megatron_logra.convert.cli import main
from megatron_logra.models.presets import load_hf_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _llama_dir(root, **config_fields):
    """A tiny Llama saved by transformers, its config.json then edited with ``config_fields``."""
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    out = root / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(config_fields)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("model_type", ["gemma", "mistral", "qwen2"])
def test_transformers_builds_the_model_of_model_type(model_type, tmp_path):
    """The premise, from transformers itself: ``architectures`` does not choose the class."""
    hf = _llama_dir(tmp_path, model_type=model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    assert type(built).__name__ != "LlamaForCausalLM"


@pytest.mark.parametrize("model_type", ["gemma", "mistral", "qwen2", "not_a_model"])
def test_hf_to_mcore_refuses_a_model_type_of_another_family(model_type, tmp_path, capsys):
    hf = _llama_dir(tmp_path, model_type=model_type)
    capsys.readouterr()  # transformers' save progress
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"architectures=['LlamaForCausalLM'] names a llama model but model_type='{model_type}'" in err
    assert '"model_type": "llama"' in err
    assert not (tmp_path / "mc").exists()


def test_train_config_and_planner_refuse_it_too(tmp_path, capsys):
    hf = _llama_dir(tmp_path, model_type="gemma")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["config", "tiny", f"--model.hf_path={hf}", "model.seq_length=32"])
    assert exit_info.value.code == 2
    assert "model_type='gemma'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"names a llama model but model_type='gemma'"):
        load_hf_config(hf)


def test_a_matching_or_missing_model_type_still_loads(tmp_path):
    assert load_hf_config(_llama_dir(tmp_path)).num_layers == 2
    hf = tmp_path / "hf"
    raw = json.loads((hf / "config.json").read_text())
    del raw["model_type"]
    (hf / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(hf).num_layers == 2
