"""A delta-directory consumer whose engine is at ``weight_version = -1`` (a full-weights load that failed part-way
left its weights partly replaced) is refused with ``SyncError("anchor")`` while the directory holds an anchor, and
``follow`` reloads that anchor's full weights, also when no delta has been published after the anchor yet: the
consumer must not report "nothing new" while its weights are a mix of two versions."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.fingerprint import fingerprint
from test_sync_transport import _hf_state as _state, _HFModule as _HF


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _half_loaded_engine(weights):
    """A ModuleEngine whose full load failed after three tensors (the stream's read error, as on NFS ESTALE)."""
    engine = ModuleEngine(_HF(_state(seed=9)))

    def stream():
        for i, item in enumerate(weights.items()):
            if i == 3:
                raise OSError(116, "Stale file handle")
            yield item

    with pytest.raises(OSError):
        engine.update_weights_full(stream(), 0)
    assert engine.weight_version == -1
    return engine


def _equal(engine, weights):
    return all(torch.equal(t, weights[name]) for name, t in engine.weights().items())


def test_consume_refuses_an_engine_of_unknown_version_and_follow_reloads(tmp_path):
    producer = DirectoryTransport(tmp_path)
    producer.claim()
    weights = _state()
    producer.write_anchor(0, fingerprint(weights, salt=0), full=producer.write_full(0, weights))
    engine = _half_loaded_engine(weights)
    assert not _equal(engine, weights)

    consumer = DirectoryTransport(tmp_path)
    with pytest.raises(SyncError) as exc:
        consumer.consume(engine)  # nothing after the anchor yet: still not "nothing new"
    assert exc.value.kind == "anchor" and "-1" in str(exc.value)
    assert engine.weight_version == -1

    assert consumer.follow(engine) == []
    assert engine.weight_version == 0 and _equal(engine, weights)
    assert consumer.consume(engine) == []  # verified now


def test_a_directory_without_anchors_still_answers_nothing_new(tmp_path):
    """Without any anchor marker there is nothing to reload: the version-chain checks alone apply, as before."""
    DirectoryTransport(tmp_path).claim()
    engine = _half_loaded_engine(_state())
    assert DirectoryTransport(tmp_path).consume(engine) == []
