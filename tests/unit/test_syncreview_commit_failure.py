"""``ModuleEngine.apply_sketch_delta``: a commit that fails after some weights were written (an in-place kernel
error; here a weight the kernels cannot write in place, an expanded view whose rows share memory) leaves
``weight_version = -1``, so the same delta is refused instead of being merged a second time into the weights it
already changed, and a delta-directory consumer reloads the anchor's full weights."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.synthetic import random_delta
from test_sync_transport import SHAPE, _hf_state as _state, _HFModule as _HF

BROKEN = "model.layers.1.mlp.down_proj.weight"  # the last weight the commit writes


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _engine_with_unwritable_last_weight(state):
    module = _HF(state)
    p = getattr(module, f"p{module._names.index(BROKEN)}")
    p.data = p.data[:1].expand_as(p.data)  # every row is row 0: in-place kernels refuse to write it
    return ModuleEngine(module)


def _snapshot(engine):
    return {k: v.clone() for k, v in engine.weights().items()}


def test_a_commit_that_fails_part_way_leaves_the_version_unknown():
    engine = _engine_with_unwritable_last_weight(_state())
    before = _snapshot(engine)
    delta = random_delta(SHAPE, 8, scale=0.02)
    with pytest.raises(SyncError) as exc:
        engine.apply_sketch_delta(delta)
    assert exc.value.kind == "apply" and "partially written" in str(exc.value)
    changed = [k for k, v in engine.weights().items() if not torch.equal(v, before[k])]
    assert changed, "the commit wrote some weights before it failed"
    assert engine.weight_version == -1

    once = _snapshot(engine)
    with pytest.raises(SyncError) as again:  # a retry must not merge the delta a second time
        engine.apply_sketch_delta(delta)
    assert again.value.kind == "gap"
    assert all(torch.equal(v, once[k]) for k, v in engine.weights().items())


def test_a_directory_consumer_reloads_after_a_failed_commit(tmp_path):
    producer = DirectoryTransport(tmp_path)
    producer.claim()
    weights = _state()
    producer.write_anchor(0, fingerprint(weights, salt=0), full=producer.write_full(0, weights))
    producer.publish(random_delta(SHAPE, 8, scale=0.02))

    engine = _engine_with_unwritable_last_weight(_state())
    consumer = DirectoryTransport(tmp_path)
    consumer.accept_anchor(0)  # the engine's weights count as the anchor's (its last weight is not the file's)
    with pytest.raises(SyncError) as exc:
        consumer.consume(engine)
    assert exc.value.kind == "apply" and engine.weight_version == -1
    with pytest.raises(SyncError) as exc:  # not applied again on top of the half-written weights
        consumer.consume(engine)
    assert exc.value.kind in ("gap", "anchor") and engine.weight_version == -1
