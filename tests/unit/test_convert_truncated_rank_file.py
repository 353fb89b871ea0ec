"""A rank file of a ``convert hf-to-mcore`` output that was cut short (an interrupted copy to another node) or
grew is named by its size against ``meta.json``, before any read, also with the checksum pass skipped
(``--no-verify``); a same-size corruption is still the sha256 mismatch."""

from __future__ import annotations

import shutil

import pytest

from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from support.convert_fixtures import snapshot, tiny_llama_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("truncated")
    out = root / "mcore_tp2"
    convert_hf_to_mcore(tiny_llama_checkpoint(root), out, tp=2)
    return out


def _damaged(converted, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    f = bad / "model_tp1_pp0.safetensors"
    f.write_bytes(edit(f.read_bytes()))
    return bad, f


@pytest.mark.parametrize("verify", [True, False])
def test_a_rank_file_cut_short_is_named_by_its_size(converted, tmp_path, verify):
    bad, f = _damaged(converted, tmp_path, lambda data: data[: len(data) // 2])
    before = snapshot(bad)
    with pytest.raises(ValueError, match=rf"{f}: \d+ bytes, meta.json records \d+: the file is cut short"):
        convert_mcore_to_hf(bad, tmp_path / "hf_out", verify=verify)
    assert snapshot(bad) == before and not (tmp_path / "hf_out" / "config.json").exists()


def test_a_rank_file_that_grew_is_named_by_its_size(converted, tmp_path):
    bad, f = _damaged(converted, tmp_path, lambda data: data + b"\0" * 16)
    with pytest.raises(ValueError, match=rf"{f}: \d+ bytes, meta.json records \d+: the file is longer than written"):
        convert_mcore_to_hf(bad, tmp_path / "hf_out")


def test_a_same_size_corruption_is_the_checksum_mismatch(converted, tmp_path):
    bad, f = _damaged(converted, tmp_path, lambda data: data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    with pytest.raises(ValueError, match=rf"{f}: sha256 .* does not match meta.json"):
        convert_mcore_to_hf(bad, tmp_path / "hf_out")
