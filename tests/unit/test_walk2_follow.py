"""A consumer pointed at a directory that is not a delta directory is told so instead of waiting forever."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.sync import DirectoryTransport, SyncError, encode
from megatron_logra.sync.synthetic import DenseShape, random_delta


class _Engine:
    """The least a consumer needs: a version and an apply that counts."""

    weight_version = 0

    def apply_sketch_delta(self, delta):
        self.weight_version = delta.new_version
        return delta.new_version


def test_a_run_directory_is_refused_naming_its_delta_directory(tmp_path):
    run = tmp_path / "run"
    (run / "deltas" / "rank0").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    (run / "checkpoints").mkdir()
    chain = DirectoryTransport(run)
    with pytest.raises(SyncError) as exc:
        chain.follow(_Engine())
    assert exc.value.kind == "config"
    assert "not a delta directory" in str(exc.value) and str(run / "deltas" / "rank0") in str(exc.value)
    with pytest.raises(SyncError, match="not a delta directory"):
        chain.poll(0)


def test_a_directory_of_other_files_is_refused(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(SyncError, match=r"not a delta directory.*readme\.txt.*rank<N>"):
        DirectoryTransport(tmp_path).consume(_Engine())


def test_a_created_directory_warns_once_and_a_real_chain_still_applies(tmp_path, caplog):
    missing = tmp_path / "typo"
    chain = DirectoryTransport(missing)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.sync.transport"):
        assert chain.follow(_Engine()) == [] and chain.follow(_Engine()) == []
    assert sum("did not exist and was created empty" in r.getMessage() for r in caplog.records) == 1
    # an existing empty directory (a trainer not started yet) waits quietly, and a chain is followed
    (tmp_path / "rank0").mkdir()
    caplog.clear()
    consumer = DirectoryTransport(tmp_path / "rank0")
    with caplog.at_level(logging.WARNING, logger="megatron_logra.sync.transport"):
        assert consumer.follow(_Engine()) == []
    assert not caplog.records
    producer = DirectoryTransport(tmp_path / "rank0")
    producer.claim()
    shape = DenseShape(hidden=16, layers=1, heads=2, kv_heads=1, ffn=24, vocab=20)
    producer.publish(encode(random_delta(shape, rank=4, base_version=0, new_version=1, seed=0)))
    assert consumer.follow(_Engine()) == [1]
