"""Reloading a directory transport's full-weights file into an engine (``DirectoryTransport.load_full``,
``ModuleEngine.update_weights_full``): a failed load never leaves an engine that looks valid, the anchor
accepted is the one whose file was read, and a file of the model's real vocabulary loads into an engine
holding that vocabulary or a padded one.

Real files, real ``ModuleEngine``s and ``apply_delta_``."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from test_sync_transport import _hf_state, _HFModule
from test_syncfix_directory_anchor import _delta


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _snapshot(engine):
    return {k: v.clone() for k, v in engine.weights().items()}


def _same(engine, weights):
    got = engine.weights()
    return set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights)


def _anchored(directory, weights, version):
    producer = DirectoryTransport(directory)
    producer.write_anchor(version, fingerprint(weights, salt=version), full=producer.write_full(version, weights))
    return producer


# ---------------------------------------------------------------------- a stream that fails midway
def test_a_stream_that_raises_after_a_copy_leaves_the_version_unknown():
    engine = ModuleEngine(_HFModule(_hf_state()), version=3)
    new = _hf_state(seed=5)

    def stream():
        yield from list(new.items())[:1]
        raise OSError(116, "Stale file handle")

    with pytest.raises(OSError, match="Stale file handle"):
        engine.update_weights_full(stream(), 7)
    assert engine.weight_version == -1  # partly replaced: no delta applies until a full load succeeds


def test_a_stream_that_raises_before_any_copy_keeps_weights_and_version():
    engine = ModuleEngine(_HFModule(_hf_state()), version=3)
    before = _snapshot(engine)

    def stream():
        raise OSError(5, "Input/output error")
        yield  # pragma: no cover

    with pytest.raises(OSError):
        engine.update_weights_full(stream(), 7)
    assert engine.weight_version == 3 and _same(engine, before)


def test_a_file_cut_short_while_it_is_read_leaves_the_engine_at_version_minus_one(tmp_path):
    _anchored(tmp_path, _hf_state(seed=1), 4)
    consumer = DirectoryTransport(tmp_path)

    class Engine(ModuleEngine):
        def update_weights_full(self, tensors, version):
            def stream():
                for i, item in enumerate(tensors):
                    yield item
                    if i == 0:  # the file loses its data after the first tensor was read
                        path = tmp_path / "full_00000004.safetensors"
                        os.truncate(path, os.path.getsize(path) // 2)
            return super().update_weights_full(stream(), version)

    engine = Engine(_HFModule(_hf_state()), version=2)
    with pytest.raises(SyncError, match="ends inside") as exc:
        consumer.load_full(engine)
    assert exc.value.kind == "truncated" and engine.weight_version == -1


# ---------------------------------------------------------------------- the anchor accepted is the file's
def test_load_full_accepts_the_anchor_it_read_not_a_newer_marker_at_that_version(tmp_path):
    """While the consumer streams the refit at version 2, the trainer restarts from its checkpoint at 0 and,
    on another trajectory, refits at version 2 again (a new marker, other weights) and publishes 2 -> 3. The
    engine holds the first file's weights: the new marker must stay unverified, so consume refuses at it."""
    producer = _anchored(tmp_path, _hf_state(), 0)
    weights, version = _hf_state(), 0
    for _ in range(2):
        d = _delta(version, 1)
        producer.publish(d)
        apply_delta_(weights, d, version)
        version += 1
    weights = {k: t * 1.5 for k, t in weights.items()}
    first = producer.write_anchor(2, fingerprint(weights, salt=2), full=producer.write_full(2, weights))

    def restart_and_refit_at_2():
        restarted = DirectoryTransport(tmp_path)
        restarted.clear(above_version=0)
        other, v = _hf_state(), 0
        for _ in range(2):
            d = _delta(v, 2)
            restarted.publish(d)
            apply_delta_(other, d, v)
            v += 1
        other = {k: t * 0.5 for k, t in other.items()}
        restarted.write_anchor(2, fingerprint(other, salt=2), full=restarted.write_full(2, other))
        restarted.publish(_delta(2, 2))

    class Engine(ModuleEngine):
        def update_weights_full(self, tensors, version):
            def stream():
                for i, item in enumerate(tensors):
                    if i == 0:
                        restart_and_refit_at_2()
                    yield item
            return super().update_weights_full(stream(), version)

    consumer, engine = DirectoryTransport(tmp_path), Engine(_HFModule(_hf_state(seed=7)))
    accepted = consumer.load_full(engine)
    assert accepted["epoch"] == first["epoch"] and engine.weight_version == 2
    assert _same(engine, {k: t.to(torch.float32) for k, t in weights.items()})
    assert consumer.anchors()[-1]["epoch"] != first["epoch"]  # the marker at 2 now is the restarted run's
    with pytest.raises(SyncError, match="differ from the trainer's anchor") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "anchor" and engine.weight_version == 2
    consumer.load_full(engine)  # the new trajectory's file: then its deltas apply
    assert consumer.consume(engine) == [3]
