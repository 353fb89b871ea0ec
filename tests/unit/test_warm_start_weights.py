"""Warm-start weight files (``rl.sft.save_weights`` / ``load_weights``): the cache of the supervised
warm start and ``sft.init_path``. A file round-trips exactly, a byte flipped at the same size or a
truncated file is a ``ValueError`` naming the file with nothing loaded, files without a recorded
CRC-32 (older ones) still load, a writer never writes into another writer's temp file, the last
stage's copy of tied word embeddings loads from the file's word embeddings, and a file saved at another
vocabulary padding (another TP size: ``tiny``'s warm start into a TP 4 model) loads its vocabulary rows."""

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


class _VocabLayers(torch.nn.Module):
    """The vocabulary tensors of an untied model whose vocabulary (``VOCAB`` tokens) is padded to ``rows``."""

    share_embeddings_and_output_weights = False

    def __init__(self, rows: int, hidden: int = 4):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(rows, hidden)
        self.output_layer = torch.nn.Linear(hidden, rows, bias=False)


VOCAB = 146
"""The tiny recipe's model.vocab_size: padded to 160 rows at TP 1 and 2, to 192 at TP 4 (multiples of 16 × TP)."""


def _vocab_file(tmp_path, rows: int):
    tensors = {"embedding.word_embeddings.weight": torch.randn(rows, 4), "output_layer.weight": torch.randn(rows, 4)}
    path = tmp_path / f"warm_{rows}.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("saved_rows, model_rows", [(160, 192), (192, 160)], ids=["tp1_to_tp4", "tp4_to_tp1"])
def test_a_file_saved_at_another_vocab_padding_loads_its_vocabulary_rows(tmp_path, saved_rows, model_rows):
    # a warm start saved at TP 1 (160 rows) into a TP 4 model (192 rows), and back: the rows of the VOCAB
    # tokens are the file's, the padding rows zeros
    path, tensors = _vocab_file(tmp_path, saved_rows)
    model = _VocabLayers(model_rows)
    load_weights(model, ParallelGroups(), path, vocab_size=VOCAB)
    for loaded, name in ((model.embedding.word_embeddings.weight, "embedding.word_embeddings.weight"),
                         (model.output_layer.weight, "output_layer.weight")):
        assert torch.equal(loaded[:VOCAB], tensors[name][:VOCAB])
        assert not loaded[VOCAB:].any()


def test_a_file_with_fewer_rows_than_the_vocabulary_is_still_refused(tmp_path):
    path, _ = _vocab_file(tmp_path, 112)  # a warm start of a model with a smaller vocabulary
    with pytest.raises(ValueError, match=r"embedding.word_embeddings.weight has shape \(112, 4\), which does not fit"):
        load_weights(_VocabLayers(160), ParallelGroups(), path, vocab_size=VOCAB)


def test_the_shipped_warm_start_loads_into_the_tiny_model_padded_for_tp4(tmp_path, monkeypatch):
    # the job's own call: sft.init_path of the tiny recipe into its model as TP 4 pads it (192 rows; 160 saved)
    from megatron_logra.config import load_recipe
    from megatron_logra.rl.warm_start import warm_start

    cfg = load_recipe("tiny")
    model = _VocabLayers(cfg.model.padded_vocab_size(4), cfg.model.hidden_size)
    monkeypatch.setattr("megatron_logra.rl.sft.global_param_names",
                        lambda m: {n: n for n, _ in m.named_parameters() if n.startswith(("embedding", "output"))})
    warm_start(cfg, model, ParallelGroups(), task=None, tok=None)
    shipped = load_file(cfg.sft.init_path)["embedding.word_embeddings.weight"]
    assert shipped.shape[0] == cfg.model.padded_vocab_size(1) != model.embedding.word_embeddings.weight.shape[0]
    assert torch.equal(model.embedding.word_embeddings.weight[:cfg.model.vocab_size], shipped[:cfg.model.vocab_size])
