"""Files in a delta directory whose names only look like the producer's: a version spelled with an extra leading
zero (``delta_000000003.safetensors`` beside the producer's ``delta_00000003.safetensors``) is not the producer's
file and is left alone, by the consumer and by the producer's ``clear`` and ``prune``. Real files and a real
:class:`ModuleEngine`."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.synthetic import random_delta
from test_sync_transport import SHAPE, _hf_state as _state, _HFModule as _HF

STRAYS = ("delta_000000003.safetensors", "delta_000000004.safetensors", "anchor_000000002.json",
          "full_000000002.safetensors")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_names_with_an_extra_leading_zero_are_not_taken_for_the_producers_files(tmp_path):
    """They used to be read as versions 3, 4 and 2: version 3 twice (the second time a bogus "forks from the
    chain" error blaming the producer's own delta_00000003), version 4 as a file "removed while this consumer
    read the chain", and the marker as a malformed anchor that stops every consumer."""
    producer = DirectoryTransport(tmp_path)
    producer.claim()
    weights = _state()
    producer.write_anchor(0, fingerprint(weights, salt=0), full=producer.write_full(0, weights))
    for v in range(3):
        d = random_delta(SHAPE, 8, base_version=v, new_version=v + 1, update_index=v, seed=3, generator_seed=v,
                         scale=0.02)
        apply_delta_(weights, d, v)
        producer.publish(d)
    for name in STRAYS:
        (tmp_path / name).write_bytes(b"not the producer's")

    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state()))
    assert consumer.versions() == [1, 2, 3] and [a["version"] for a in consumer.anchors()] == [0]
    assert consumer.follow(engine) == [1, 2, 3]
    assert consumer.follow(engine) == []
    assert all(torch.equal(t, weights[n]) for n, t in engine.weights().items())

    assert producer.prune(3) == [1, 2]
    assert set(STRAYS) <= set(p.name for p in tmp_path.iterdir())
    removed = producer.clear()
    assert not set(STRAYS) & set(removed) and all((tmp_path / name).exists() for name in STRAYS)
