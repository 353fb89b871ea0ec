"""``hf-to-mcore --force`` replaces an earlier ``hf-to-mcore`` output only, never a Hugging Face checkpoint.

``--force`` used to accept any ``--out`` holding only file names a conversion writes, and a Hugging Face
checkpoint (config.json, safetensors, tokenizer files) is made of exactly those: ``hf-to-mcore --hf A --out B
--force`` with ``B`` another model's directory (a typo, a swapped argument) deleted that model and left
megatron-core rank files in its place. Now such an ``--out`` is refused, naming what it holds, and left as it
was; an earlier ``hf-to-mcore`` output (its ``meta.json``) is still replaced, and ``mcore-to-hf --force``
still replaces an earlier export."""

from __future__ import annotations

import filecmp

import pytest
import torch
from safetensors.torch import load_file

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_logra.convert.cli import main
from support.convert_fixtures import tiny_llama_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _save(path, seed: int):
    return tiny_llama_checkpoint(path.parent, name=path.name, seed=seed, tokenizer_stub=True)


def _snapshot(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_force_does_not_replace_a_hugging_face_checkpoint(tmp_path, capsys):
    source, other = _save(tmp_path / "a", 0), _save(tmp_path / "b", 1)
    before = _snapshot(other)
    capsys.readouterr()
    assert main(["hf-to-mcore", "--hf", str(source), "--out", str(other), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--out {other} is not an earlier `convert hf-to-mcore` output" in err
    assert "'config.json'" in err and "Hugging Face checkpoint" in err and "choose another --out" in err
    assert _snapshot(other) == before
    assert not any(p.name.startswith(".b.") for p in tmp_path.iterdir())


def test_force_still_replaces_an_earlier_hf_to_mcore_output(tmp_path):
    source = _save(tmp_path / "a", 0)
    out = tmp_path / "mc"
    convert_hf_to_mcore(source, out, tp=1)
    convert_hf_to_mcore(source, out, tp=2, force=True)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model_tp0_pp0.safetensors", "model_tp1_pp0.safetensors"]


def test_mcore_to_hf_force_still_replaces_an_earlier_export(tmp_path):
    source = _save(tmp_path / "a", 0)
    convert_hf_to_mcore(source, tmp_path / "mc", tp=2)
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "hf")
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "hf", force=True)
    assert filecmp.cmp(source / "config.json", tmp_path / "hf" / "config.json", shallow=False)
    original, back = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[n], original[n]) for n in original)
