"""``mcore-to-hf --force`` replaces an earlier export only, and ``--dtype`` writes every tensor in one dtype.

``--force`` used to replace any ``--out`` holding only file names a conversion writes, and every Hugging Face
checkpoint is made of exactly those: ``mcore-to-hf --out /ckpt/Qwen2.5-7B --force`` (the model a run started
from, by a slip) deleted it. Each shard of an export now carries a mark in its safetensors ``__metadata__``,
and ``--force`` refuses an ``--out`` whose weight files lack it, leaving it as it was.

A run in bfloat16 keeps its norm weights in float32; an export writes them as stored while config.json names
bfloat16. ``--dtype bfloat16`` writes every tensor in bfloat16, as ``save_pretrained`` of a bfloat16 model does:
checked against the source tensors cast by torch, and by loading the export with transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_logra.convert.cli import main
from support.convert_fixtures import snapshot, tiny_llama_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _mixed_precision_checkpoint(root):
    """A tiny Llama whose linear and embedding weights are bfloat16 and whose norm weights are float32 (the
    dtypes of a bfloat16 training run's parameters), with config.json naming bfloat16."""
    hf = tiny_llama_checkpoint(root, name="mixed", seed=3)
    tensors = load_file(str(hf / "model.safetensors"))
    mixed = {n: (t if "norm" in n else t.to(torch.bfloat16)) for n, t in tensors.items()}
    save_file(mixed, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (hf / "config.json").write_text(json.dumps(config))
    return hf, mixed


def test_force_refuses_a_checkpoint_the_export_did_not_write(tmp_path, capsys):
    source = tiny_llama_checkpoint(tmp_path, name="a", seed=0, tokenizer_stub=True)
    other = tiny_llama_checkpoint(tmp_path, name="b", seed=1, tokenizer_stub=True)
    convert_hf_to_mcore(source, tmp_path / "mc", tp=2)
    before = snapshot(other)
    capsys.readouterr()
    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(other), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--out {other.resolve()} is not an earlier `convert mcore-to-hf` output" in err
    assert "model.safetensors" in err and "choose another --out" in err
    assert snapshot(other) == before
    assert not any(p.name.startswith(".b.") for p in tmp_path.iterdir())


def test_force_replaces_an_earlier_export_and_each_shard_carries_the_mark(tmp_path):
    source = tiny_llama_checkpoint(tmp_path, name="a", seed=0)
    convert_hf_to_mcore(source, tmp_path / "mc", tp=2)
    out = tmp_path / "hf"
    convert_mcore_to_hf(tmp_path / "mc", out, max_shard_size="20KB")
    convert_mcore_to_hf(tmp_path / "mc", out, max_shard_size="20KB", force=True)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1
    for path in shards:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert meta["format"] == "pt" and meta["converted_by"] == "megatron-logra mcore-to-hf"
    # an export whose mark was removed (as a release before the mark wrote it) is refused too
    name = shards[0]
    save_file(load_file(str(name)), str(name), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name.name} does not carry"):
        convert_mcore_to_hf(tmp_path / "mc", out, max_shard_size="20KB", force=True)


def test_export_writes_as_stored_by_default_and_all_in_one_dtype_with_dtype(tmp_path, capsys):
    hf, mixed = _mixed_precision_checkpoint(tmp_path)
    convert_hf_to_mcore(hf, tmp_path / "mc", tp=2)

    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "stored")
    stored = load_file(str(tmp_path / "stored" / "model.safetensors"))
    assert {n: t.dtype for n, t in stored.items()} == {n: t.dtype for n, t in mixed.items()}
    assert all(torch.equal(stored[n], mixed[n]) for n in mixed)

    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "bf16"),
                 "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    cast = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert set(cast) == set(mixed)
    for name, tensor in mixed.items():
        assert cast[name].dtype == torch.bfloat16, name
        assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.model.norm.weight, mixed["model.norm.weight"].to(torch.bfloat16))

    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "fp32"),
                 "--dtype", "float32"]) == 0
    wide = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert all(wide[n].dtype == torch.float32 and torch.equal(wide[n], t.float()) for n, t in mixed.items())
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["torch_dtype"] == "float32"


def test_dtype_names_only_floating_point_dtypes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["mcore-to-hf", "--mcore", str(tmp_path), "--out", str(tmp_path / "o"), "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        convert_mcore_to_hf(tmp_path, tmp_path / "o", dtype=torch.int8)
