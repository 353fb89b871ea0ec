"""A safetensors header whose fields have the wrong JSON types is rejected by ``read_header`` with a
``ValueError`` naming the file and the field, exactly where the safetensors library rejects it too
(the library is the reference: every corrupt header here must fail ``safe_open`` as well, and the
unmodified file must load in both)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_logra.convert.cli import main as convert_main
from megatron_logra.convert.st_io import TensorFile, read_header


def _write(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture()
def good(tmp_path):
    """A real safetensors file (two tensors) and its parsed header and data bytes."""
    path = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)},
              str(path), metadata={"format": "pt"})
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _library_rejects(path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:  # the library raises its own SafetensorError (or a deserialisation error)
        return True
    return False


CORRUPTIONS = {
    "metadata_list": (lambda h: h.__setitem__("__metadata__", ["x"]), "__metadata__"),
    "metadata_string": (lambda h: h.__setitem__("__metadata__", "pt"), "__metadata__"),
    "metadata_int_value": (lambda h: h.__setitem__("__metadata__", {"format": 1}), "__metadata__"),
    "shape_float": (lambda h: h["a"].__setitem__("shape", [2, 3.0]), "shape"),
    "shape_fraction": (lambda h: h["b"].__setitem__("shape", [4.9]), "shape"),
    "shape_string": (lambda h: h["b"].__setitem__("shape", ["4"]), "shape"),
    "shape_bool": (lambda h: h["b"].__setitem__("shape", [True, 4]), "shape"),
    "shape_negative": (lambda h: h["b"].__setitem__("shape", [-4]), "shape"),
    "shape_not_list": (lambda h: h["b"].__setitem__("shape", 4), "shape"),
    "dtype_not_string": (lambda h: h["b"].__setitem__("dtype", 16), "dtype"),
    "offsets_float": (lambda h: h["b"].__setitem__("data_offsets", [24.0, 32]), "data_offsets"),
    "offsets_three": (lambda h: h["b"].__setitem__("data_offsets", [24, 32, 32]), "data_offsets"),
    "entry_not_object": (lambda h: h.__setitem__("b", [1, 2]), "not an object"),
    "entry_no_shape": (lambda h: h["b"].pop("shape"), "no 'shape'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_wrong_field_types_are_a_value_error_naming_file_and_field(case, good, tmp_path):
    header, data = good
    mutate, field = CORRUPTIONS[case]
    mutate(header)
    path = tmp_path / f"{case}.safetensors"
    _write(path, header, data)
    assert _library_rejects(path), f"the safetensors library accepts {case}: not a corrupt header"
    with pytest.raises(ValueError) as info:
        read_header(path)
    msg = str(info.value)
    assert str(path) in msg and field in msg, msg


def test_valid_headers_still_load(good, tmp_path):
    header, data = good
    for name, mutate in (("plain", lambda h: None), ("null_metadata", lambda h: h.__setitem__("__metadata__", None)),
                         ("no_metadata", lambda h: h.pop("__metadata__"))):
        mutate(header)
        path = tmp_path / f"{name}.safetensors"
        _write(path, header, data)
        assert not _library_rejects(path)
        with TensorFile(path) as f:
            assert torch.equal(f.read("a"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
            assert torch.equal(f.read("b"), torch.ones(4, dtype=torch.float16))
            assert f.tensors["a"].shape == (2, 3) and all(type(s) is int for s in f.tensors["a"].shape)
            assert f.metadata == ({"format": "pt"} if name == "plain" else {})


def test_cli_reports_a_list_metadata_in_one_line(good, tmp_path, capsys):
    header, data = good
    header["__metadata__"] = ["x"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    _write(hf / "model.safetensors", header, data)
    assert convert_main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "__metadata__" in err and str(hf / "model.safetensors") in err, err
    assert not (tmp_path / "out").exists()
