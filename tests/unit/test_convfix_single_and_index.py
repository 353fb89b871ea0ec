"""A Hugging Face directory holding both ``model.safetensors`` and ``model.safetensors.index.json`` with other
shards is two saves of the weights (``save_pretrained`` of a sharded model into a directory that held a
single-file save keeps the old file). transformers' ``from_pretrained`` reads ``model.safetensors`` there and
ignores the index; the importer used to read the index, so the converted (or trained-from) model silently
differed from the one transformers loads. Such a directory is now refused by ``hf-to-mcore`` and by
``load_hf_into_model`` (``train --model.hf_path``), naming both files and the fix, before anything is written;
an index that names ``model.safetensors`` itself is one save and still converts, bit for bit."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_logra.convert.cli import main

INDEX = "model.safetensors.index.json"
CONFIG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _model(seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """A directory saved twice with transformers, one file first, then sharded: both models and the directory."""
    out = tmp_path_factory.mktemp("two_saves") / "hf"
    first, second = _model(0), _model(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.save_pretrained(out)
        second.save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors").is_file() and (out / INDEX).is_file()
    return out, first, second


def test_transformers_reads_the_single_file_of_such_a_directory(two_saves):
    """The premise, checked against transformers itself: the weights it loads are the first save's."""
    out, first, second = two_saves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    emb = loaded.get_input_embeddings().weight
    assert torch.equal(emb, first.get_input_embeddings().weight)
    assert not torch.equal(emb, second.get_input_embeddings().weight)


def test_hf_to_mcore_refuses_two_saves_naming_both_files(two_saves, tmp_path, capsys):
    out, _, _ = two_saves
    assert main(["hf-to-mcore", "--hf", str(out), "--out", str(tmp_path / "mc"), "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{out}: holds both model.safetensors and {INDEX}" in err
    assert "from_pretrained reads model.safetensors" in err and "remove it" in err
    assert not (tmp_path / "mc").exists() and not any(tmp_path.glob(".mc*"))


def test_loading_into_a_model_refuses_two_saves(two_saves, groups):
    from megatron_logra.convert import load_hf_into_model, model_config_from_hf
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    out, _, _ = two_saves
    cfg = model_config_from_hf(out, base=ModelConfig(seq_length=16, params_dtype="float32"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(cfg, groups, seed=1)
    with pytest.raises(ValueError, match=r"holds both model\.safetensors and model\.safetensors\.index\.json"):
        load_hf_into_model(model, groups, out, cfg)


def test_an_index_naming_the_single_file_is_one_save(tmp_path):
    """``model.safetensors`` with an index that maps every tensor to it: one save, converted as before."""
    model = _model(2)
    hf = tmp_path / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(hf)
    names = sorted(load_file(str(hf / "model.safetensors")))
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    convert_hf_to_mcore(hf, tmp_path / "mc", tp=2)
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back")
    original, back = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[n], original[n]) for n in original)
