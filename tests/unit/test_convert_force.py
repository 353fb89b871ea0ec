"""``convert --force`` replaces a previous conversion only: it refuses an output directory that
also holds files a conversion does not write (a user's notes, a sub-folder), naming them."""

from __future__ import annotations

import pytest

from megatron_logra.convert.convert import _prepare_out


def _previous_hf_conversion(out):
    out.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "generation_config.json"):
        (out / name).write_text("x")


def test_force_replaces_a_previous_conversion(tmp_path):
    _previous_hf_conversion(tmp_path / "hf")
    staging = _prepare_out(tmp_path / "hf", True, (tmp_path / "src",))
    assert staging.is_dir() and staging != (tmp_path / "hf").resolve()


def test_force_refuses_to_delete_foreign_files(tmp_path):
    out = tmp_path / "hf"
    _previous_hf_conversion(out)
    (out / "README.md").write_text("my notes")
    (out / "sub").mkdir()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match=r"README\.md.*sub/.*--force would delete them"):
        _prepare_out(out, True, (tmp_path / "src",))
    assert sorted(p.name for p in out.iterdir()) == before and (out / "README.md").read_text() == "my notes"
    with pytest.raises(ValueError, match="pass --force"):
        _prepare_out(out, False, (tmp_path / "src",))
