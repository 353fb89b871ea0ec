"""The converters write inside ``--out`` only, and never delete or overwrite an input.

* ``--out`` that contains an input (``--hf X/hf --out X``) or lies inside one (``--out HF/sub``) is
  refused (exit status 2, the input named) with or without ``--force``, before anything is deleted
  or written: ``--force`` used to delete ``X`` and with it the input weights.
* A template's ``model.safetensors.index.json`` whose shard names are not plain ``*.safetensors``
  file names (``../x``, an absolute path, a hidden or nested name, ``config.json``) is refused, as
  the input side refuses them: the export used to write such shards outside ``--out``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_logra.convert.cli import main as convert_main
from support.convert_fixtures import snapshot, tiny_llama_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mc") / "mc"
    convert_hf_to_mcore(hf_dir, out)
    return out


def _refused(argv: list[str], capsys, match: str) -> str:
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert ": error: " in err and "\n" not in err and match in err, err
    return err


# ------------------------------------------------------------------------------------------ --out vs inputs
@pytest.mark.parametrize("force", [True, False])
def test_hf_to_mcore_out_containing_the_input_is_refused(force, hf_dir, tmp_path, capsys):
    x = tmp_path / "X"
    shutil.copytree(hf_dir, x / "hf")  # the input, inside --out
    shutil.copyfile(hf_dir / "config.json", x / "config.json")  # --out "looks like a conversion"
    before = snapshot(x)
    err = _refused(["hf-to-mcore", "--hf", str(x / "hf"), "--out", str(x)] + (["--force"] if force else []),
                   capsys, "contains the input")
    assert str((x / "hf").resolve()) in err
    assert snapshot(x) == before and not (tmp_path / ".X.partial").exists()


@pytest.mark.parametrize("force", [True, False])
def test_out_inside_the_input_is_refused(force, hf_dir, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    before = snapshot(src)
    flags = ["--force"] if force else []
    _refused(["hf-to-mcore", "--hf", str(src), "--out", str(src / "mc")] + flags, capsys, "is inside the input")
    assert snapshot(src) == before and sorted(p.name for p in src.iterdir()) == sorted(before)


def test_mcore_to_hf_out_containing_an_input_is_refused(hf_dir, mcore_dir, tmp_path, capsys):
    x = tmp_path / "X"
    shutil.copytree(mcore_dir, x / "mc")
    shutil.copyfile(hf_dir / "config.json", x / "config.json")
    before = snapshot(x)
    _refused(["mcore-to-hf", "--mcore", str(x / "mc"), "--out", str(x), "--force"], capsys, "contains the input")
    assert snapshot(x) == before

    y = tmp_path / "Y"  # the template is the input inside --out
    shutil.copytree(hf_dir, y / "template")
    before = snapshot(y)
    _refused(["mcore-to-hf", "--mcore", str(mcore_dir), "--out", str(y), "--hf-template", str(y / "template"),
              "--force"], capsys, "contains the input")
    assert snapshot(y) == before

    _refused(["mcore-to-hf", "--mcore", str(mcore_dir), "--out", str(mcore_dir / "hf_out")], capsys,
             "is inside the input")
    assert not (mcore_dir / "hf_out").exists() and not (mcore_dir / ".hf_out.partial").exists()


def test_out_equal_to_the_input_is_still_refused(hf_dir, tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    _refused(["hf-to-mcore", "--hf", str(src), "--out", str(src), "--force"], capsys, "is also an input directory")
    assert (src / "model.safetensors").read_bytes() == (hf_dir / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------ template shard names
@pytest.mark.parametrize("bad", ["../escaped.safetensors", "ABSOLUTE", ".hidden.safetensors", "sub/x.safetensors",
                                 "config.json", ""])
def test_template_shard_names_must_be_plain_safetensors_names(bad, hf_dir, mcore_dir, tmp_path):
    work = tmp_path / "work"
    template = work / "template"
    shutil.copytree(hf_dir, template)
    (template / "model.safetensors").unlink()
    if bad == "ABSOLUTE":
        bad = str(tmp_path / "abs.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = sorted(AutoModelForCausalLM.from_pretrained(hf_dir).state_dict())
    half = len(names) // 2
    weight_map = {n: ("model-00001-of-00002.safetensors" if i < half else bad) for i, n in enumerate(names)}
    (template / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = work / "exp"
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: shard file name .* (is not a plain file "
                                         r"name|does not end in \.safetensors)"):
        convert_mcore_to_hf(mcore_dir, out, hf_template=template)
    assert sorted(p.name for p in work.iterdir()) == ["template"]  # no --out, no .exp.partial
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing written outside --out either
