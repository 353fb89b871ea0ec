"""A consumer of a delta directory needs only read access: on a read-only share (a consumer node's read-only mount
of the trainer's storage) it waits for a rank directory the trainer has not created yet, and follows one that is
there; a producer pointed at such a share is refused at ``claim`` naming the directory. Real files, a real
read-only mount (or file modes) and a real :class:`ModuleEngine`."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.synthetic import random_delta
from support.read_only import read_only
from test_sync_transport import SHAPE, _hf_state as _state, _HFModule as _HF


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _produce(directory, steps):
    """A trainer's chain: a refit (full weights + anchor) at 0, then ``steps`` deltas; returns its weights."""
    producer = DirectoryTransport(directory)
    producer.claim()
    weights = _state()
    producer.write_anchor(0, fingerprint(weights, salt=0), full=producer.write_full(0, weights))
    for v in range(steps):
        d = random_delta(SHAPE, 8, base_version=v, new_version=v + 1, update_index=v, seed=3, generator_seed=v,
                         scale=0.02)
        apply_delta_(weights, d, v)
        producer.publish(d)
    return weights


def test_a_consumer_on_a_read_only_share_waits_for_its_directory_and_follows_it(tmp_path):
    """The consumer starts before the trainer, on a read-only mount: constructing its transport used to raise
    ``SyncError("config")`` (it tried to create the directory), which ended the documented consumer loop before
    it began; now it warns, each poll is a retryable ``unreadable``, and once the trainer wrote the chain the same
    object follows it, bitwise."""
    share = tmp_path / "share"
    share.mkdir()
    engine = ModuleEngine(_HF(_state(seed=9)))
    with read_only(share):
        consumer = DirectoryTransport(share / "deltas" / "rank0")
        with pytest.raises(SyncError, match=r"rank0 does not exist") as exc:
            consumer.follow(engine)
        assert exc.value.kind == "unreadable" and engine.weight_version == 0
        assert not (share / "deltas").exists()
    weights = _produce(share / "deltas" / "rank0", 3)
    with read_only(share):
        assert consumer.follow(engine) == [1, 2, 3]
    assert all(torch.equal(t, weights[n]) for n, t in engine.weights().items())


def test_a_producer_on_a_read_only_share_is_refused_naming_the_directory(tmp_path):
    share = tmp_path / "share"
    share.mkdir()
    with read_only(share):
        producer = DirectoryTransport(share / "rank0")
        with pytest.raises(SyncError, match=r"cannot create the delta directory .*share/rank0 .*choose a writable "
                                            r"sync\.directory") as exc:
            producer.claim()
        assert exc.value.kind == "config"
