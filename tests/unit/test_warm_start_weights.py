"""Warm-start weight files (``rl.sft.save_weights`` / ``load_weights``): the cache of the supervised
warm start and ``sft.init_path``. A file round-trips exactly, a byte flipped at the same size or a
truncated file is a ``ValueError`` naming the file with nothing loaded, files without a recorded
CRC-32 (older ones) still load, a writer never writes into another writer's temp file, and the last
stage's copy of tied word embeddings loads from the file's word embeddings."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_logra.parallel import ParallelGroups
from megatron_logra.rl.sft import load_weights, save_weights
from test_checkpoint_checksums import _model, _weights


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture
def saved(groups, tmp_path):
    model = _model(groups, seed=3)
    path = tmp_path / "cache" / "warm_start_abc.safetensors"
    save_weights(model, groups, path, meta={"sft_loss": 0.5})
    return path, _weights(model)


def test_round_trip_is_exact_and_leaves_no_temp_file(saved, groups):
    path, want = saved
    fresh = _model(groups, seed=9)
    assert any(not torch.equal(v, want[k]) for k, v in _weights(fresh).items())
    load_weights(fresh, groups, path)
    assert all(torch.equal(v, want[k]) for k, v in _weights(fresh).items())
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_flipped_byte_is_refused_naming_the_file(saved, groups):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-9] ^= 0x10  # inside the last tensor's bytes: the header still parses, the size is unchanged
    path.write_bytes(bytes(data))
    fresh = _model(groups, seed=9)
    before = _weights(fresh)
    with pytest.raises(ValueError, match=rf"{path.name} is corrupt: its tensors do not match the CRC-32"):
        load_weights(fresh, groups, path)
    assert all(torch.equal(v, before[k]) for k, v in _weights(fresh).items())


def test_a_truncated_file_is_refused_naming_the_file(saved, groups):
    path, _ = saved
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{path.name} is not a readable safetensors file"):
        load_weights(_model(groups, seed=9), groups, path)


def test_a_file_without_a_recorded_crc_still_loads(saved, groups):
    path, want = saved
    save_file(load_file(str(path)), str(path))  # as written before CRC-32s were recorded
    fresh = _model(groups, seed=9)
    load_weights(fresh, groups, path)
    assert all(torch.equal(v, want[k]) for k, v in _weights(fresh).items())


def test_another_writers_temp_file_is_left_alone(groups, tmp_path):
    path = tmp_path / "warm_start_abc.safetensors"
    other = tmp_path / "warm_start_abc.safetensors.tmp"  # the fixed name every writer used to share
    other.write_bytes(b"another job is writing this")
    save_weights(_model(groups, seed=3), groups, path)
    assert other.read_bytes() == b"another job is writing this"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, other.name])


class _TiedLastStage(torch.nn.Module):
    """The last pipeline stage of a tied-embedding model (PP > 1): megatron keeps its copy of the word
    embeddings as ``output_layer.weight``."""

    share_embeddings_and_output_weights = True

    def __init__(self):
        super().__init__()
        self.output_layer = torch.nn.Linear(4, 8, bias=False)


@pytest.mark.parametrize("stale_output", [False, True], ids=["saved_at_pp1", "stale_output_copy"])
def test_tied_output_copy_takes_the_files_word_embeddings(stale_output, tmp_path):
    # a tied model saved at PP=1 has no output_layer.weight; one saved at PP=2 before the copies were
    # kept equal has a stale one: either way the last stage's copy must equal the first stage's embedding
    emb = torch.randn(8, 4)
    tensors = {"embedding.word_embeddings.weight": emb}
    if stale_output:
        tensors["output_layer.weight"] = torch.randn(8, 4)
    path = tmp_path / "tied.safetensors"
    save_file(tensors, str(path))
    stage = _TiedLastStage()
    load_weights(stage, ParallelGroups(), path)
    assert torch.equal(stage.output_layer.weight, emb)
