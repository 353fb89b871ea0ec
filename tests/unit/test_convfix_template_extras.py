"""``mcore-to-hf --hf-template X`` accepts every sharded X that ``hf-to-mcore --hf X`` accepts: index entries the
importer skips (a tied model's ``lm_head.weight``, old-Llama ``rotary_emb.inv_freq`` buffers) are skipped by the
template's shard layout too. The round trip keeps the template's shard names, and the exported checkpoint
holds the original weights bit for bit and gives the original model's logits in transformers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied tiny Llama saved in several shards, and the in-memory model."""
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("tied") / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out, max_shard_size="20KB")
    index = json.loads((out / INDEX).read_text())
    assert len(set(index["weight_map"].values())) >= 3 and "lm_head.weight" not in index["weight_map"]
    return out, model


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _add(hf: Path, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
    """Store ``tensor`` as ``name`` in ``shard`` (default: the template's last shard; a new name: a new file)."""
    index = json.loads((hf / INDEX).read_text())
    shard = shard or sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(str(hf / shard)) if (hf / shard).is_file() else {}
    tensors[name] = tensor.contiguous()
    save_file(tensors, str(hf / shard), metadata={"format": "pt"})
    index["weight_map"][name] = shard
    (hf / INDEX).write_text(json.dumps(index))


def _roundtrip_matches(hf: Path, model, tmp_path: Path, skipped: set[str]) -> dict:
    convert_hf_to_mcore(hf, tmp_path / "mc")
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", hf_template=hf)
    src = json.loads((hf / INDEX).read_text())["weight_map"]
    back = json.loads((tmp_path / "back" / INDEX).read_text())["weight_map"]
    assert back == {n: f for n, f in src.items() if n not in skipped}  # the template's layout, less the skipped
    written = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert written == sorted(set(back.values()))
    state = model.state_dict()
    for fname in written:
        for name, t in load_file(str(tmp_path / "back" / fname)).items():
            assert torch.equal(t, state[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    return back


def test_tied_lm_head_in_the_template_index(tied, tmp_path):
    src, model = tied
    hf = _copy(src, tmp_path / "hf")
    _add(hf, "lm_head.weight", model.state_dict()["model.embed_tokens.weight"].clone())
    _roundtrip_matches(hf, model, tmp_path, {"lm_head.weight"})


def test_rotary_inv_freq_buffers_in_the_template_index(tied, tmp_path):
    src, model = tied
    hf = _copy(src, tmp_path / "hf")
    for layer in range(2):
        _add(hf, f"model.layers.{layer}.self_attn.rotary_emb.inv_freq", torch.ones(4))
    _roundtrip_matches(hf, model, tmp_path, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2)})


def test_a_template_shard_holding_only_lm_head_is_not_written(tied, tmp_path):
    src, model = tied
    hf = _copy(src, tmp_path / "hf")
    _add(hf, "lm_head.weight", model.state_dict()["model.embed_tokens.weight"].clone(), "model-lm-head.safetensors")
    back = _roundtrip_matches(hf, model, tmp_path, {"lm_head.weight"})
    assert "model-lm-head.safetensors" not in back.values()
    assert not (tmp_path / "back" / "model-lm-head.safetensors").exists()


def test_other_template_extras_are_still_refused(tied, tmp_path):
    src, model = tied
    hf = _copy(src, tmp_path / "hf")
    convert_hf_to_mcore(hf, tmp_path / "mc")
    index = json.loads((hf / INDEX).read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = sorted(set(index["weight_map"].values()))[0]
    (hf / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensors not in the model \['model\.layers\.0\.mlp\.extra\.weight'\]"):
        convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", hf_template=hf)
    assert not (tmp_path / "back").exists()


def test_a_template_left_with_one_shard_keeps_its_index(tied, tmp_path):
    """Two template shards, the second holding only ``lm_head.weight``: the one shard left keeps the template's
    name (``model-00001-of-00002.safetensors``), so the index must be written for anything to load it."""
    src, model = tied
    hf = tmp_path / "hf"
    hf.mkdir()
    for p in src.iterdir():
        if p.suffix == ".json" and p.name != INDEX:
            (hf / p.name).write_bytes(p.read_bytes())
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(hf / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({"lm_head.weight": state["model.embed_tokens.weight"].clone()},
              str(hf / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {n: "model-00001-of-00002.safetensors" for n in state}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    back = _roundtrip_matches(hf, model, tmp_path, {"lm_head.weight"})
    assert set(back.values()) == {"model-00001-of-00002.safetensors"}
