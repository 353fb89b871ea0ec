"""Anchor markers of the directory transport: a separate consumer refuses deltas from another trajectory.

A separate engine (its own ``DirectoryTransport`` object, as in another process) follows a producer
that resumes from an earlier version (new chain, reused version numbers) or refits its weights outside
the chain; both used to be applied silently. The trainer side is a plain weights dict advanced with
``apply_delta_``; the fingerprints are ``sync.fingerprint`` of real tensors on both sides, rows sampled
with the weight version as salt (as ``PolicySync`` and ``ModuleEngine`` do).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.synthetic import random_delta
from test_sync_transport import RANK, SHAPE, _hf_state, _HFModule


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _delta(v, run):
    """The delta ``v -> v+1`` of trajectory ``run`` (a resumed run draws other data, so other factors)."""
    return random_delta(SHAPE, RANK, base_version=v, new_version=v + 1, update_index=v, seed=3,
                        generator_seed=1000 * run + v, scale=0.02)


class _Trainer:
    """The producer: weights, a version, and the anchors PolicySync writes (chain start, full refits)."""

    def __init__(self, directory, weights=None, version=0):
        self.weights = _hf_state() if weights is None else weights
        self.version = version
        self.transport = DirectoryTransport(directory)
        self.transport.clear()
        self.transport.write_anchor(version, fingerprint(self.weights, salt=version))

    def step(self, run):
        d = _delta(self.version, run)
        self.transport.publish(d)
        apply_delta_(self.weights, d, self.version)
        self.version += 1

    def refit(self, weights):
        self.weights = weights
        self.transport.write_anchor(self.version, fingerprint(self.weights, salt=self.version))


def _separate(directory, weights=None, version=0):
    return DirectoryTransport(directory), ModuleEngine(_HFModule(_hf_state() if weights is None else weights),
                                                        version=version)


def _assert_equal(engine, weights):
    for name, t in engine.weights().items():
        assert torch.equal(t, weights[name]), name


def test_the_normal_chain_with_refits_that_keep_the_weights_applies(tmp_path):
    trainer = _Trainer(tmp_path)
    consumer, engine = _separate(tmp_path)
    for _ in range(2):
        trainer.step(run=1)
    trainer.refit({k: v.clone() for k, v in trainer.weights.items()})  # sync.anchor_interval: same weights
    trainer.step(run=1)
    assert consumer.consume(engine) == [1, 2, 3]  # anchors at 0 and 2 verified by fingerprint on the way
    _assert_equal(engine, trainer.weights)
    trainer.step(run=1)
    assert consumer.consume(engine) == [4]
    restarted = DirectoryTransport(tmp_path)  # a restarted consumer object past the newest anchor (2)
    with pytest.raises(SyncError, match=r"anchored at version 2 .* passed without verifying") as exc:
        trainer.step(run=1)
        restarted.consume(engine)
    assert exc.value.kind == "anchor" and engine.weight_version == 4


def test_a_consumer_past_a_resumed_trainers_anchor_is_refused(tmp_path):
    """The resume fork: the trainer resumes at version 1 and reuses versions 2..4 for another trajectory."""
    trainer = _Trainer(tmp_path)
    consumer, engine = _separate(tmp_path)
    for _ in range(3):
        trainer.step(run=1)
    assert consumer.consume(engine) == [1, 2, 3]
    at_1 = _hf_state()
    apply_delta_(at_1, _delta(0, run=1), 0)
    resumed = _Trainer(tmp_path, weights={k: v.clone() for k, v in at_1.items()}, version=1)  # clear + anchor at 1
    for _ in range(3):
        resumed.step(run=2)
    before = {k: v.clone() for k, v in engine.weights().items()}
    with pytest.raises(SyncError, match=r"anchored at version 1 .*\(at version 3\) passed without verifying: its "
                                        r"weights may come from another trajectory .* reload the trainer's full "
                                        r"weights at version 1 into the engine and call accept_anchor\(1\)") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "anchor" and engine.weight_version == 3
    _assert_equal(engine, before)  # nothing applied
    # the remedy: reload the anchor's weights; the fingerprint verifies them and the new chain applies
    reloaded = ModuleEngine(_HFModule(at_1), version=1)
    assert consumer.consume(reloaded) == [2, 3, 4]
    _assert_equal(reloaded, resumed.weights)


def test_a_trainer_refit_outside_the_chain_is_refused(tmp_path):
    trainer = _Trainer(tmp_path)
    consumer, engine = _separate(tmp_path)
    behind_consumer, behind = _separate(tmp_path)
    trainer.step(run=1)
    assert behind_consumer.consume(behind) == [1]
    trainer.step(run=1)
    assert consumer.consume(engine) == [1, 2]
    trainer.refit(_hf_state(seed=7))  # a re-anchor / drift repair: other weights at version 2
    trainer.step(run=1)
    with pytest.raises(SyncError, match=r"the engine's weights at version 2 differ from the trainer's anchor at that "
                                        r"version .* in \d+ tensors .*the trainer refit or restarted there") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "anchor" and engine.weight_version == 2
    with pytest.raises(SyncError, match="differ from the trainer's anchor"):  # behind: applies 2, then stops
        behind_consumer.consume(behind)
    assert behind.weight_version == 2
    # an engine that cannot fingerprint is refused too, until the caller accepts a reload
    blind = ModuleEngine(_HFModule(_hf_state(seed=7)), version=2)
    blind.fingerprint = None
    blind_consumer = DirectoryTransport(tmp_path)
    with pytest.raises(SyncError, match="cannot be verified \\(the engine cannot fingerprint its weights\\)"):
        blind_consumer.consume(blind)
    blind_consumer.accept_anchor(2)
    assert blind_consumer.consume(blind) == [3]
    _assert_equal(blind, trainer.weights)


def test_the_producers_own_engine_is_never_refused_or_fingerprinted(tmp_path):
    transport = DirectoryTransport(tmp_path)
    engine = ModuleEngine(_HFModule(_hf_state()))

    def never():
        raise AssertionError("fingerprinted")

    engine.fingerprint = never
    transport.write_anchor(0, None, own_engine=True)  # a chain start without a fingerprint
    weights = _hf_state()
    for v in range(4):
        d = _delta(v, run=1)
        transport.publish(d)
        apply_delta_(weights, d, v)
        assert transport.consume(engine) == [v + 1]
        if v == 1:  # the producer refit its own engine at version 2 with other weights
            weights = _hf_state(seed=5)
            for name, t in engine.weights().items():
                t.copy_(weights[name])
            transport.write_anchor(2, fingerprint(weights), own_engine=True)
    _assert_equal(engine, weights)


def test_poll_stops_at_an_unverified_anchor_and_markers_are_checked(tmp_path):
    trainer = _Trainer(tmp_path)
    for _ in range(2):
        trainer.step(run=1)
    trainer.refit(_hf_state(seed=3))
    trainer.step(run=1)
    consumer = DirectoryTransport(tmp_path)
    with pytest.raises(SyncError, match="no engine to fingerprint"):
        consumer.poll(0)
    consumer.verify_anchor(ModuleEngine(_HFModule(_hf_state())))
    assert [d.new_version for d in consumer.poll(0)] == [1, 2]  # stops before the anchor at 2
    consumer.accept_anchor(2)
    assert [d.new_version for d in consumer.poll(2)] == [3]
    with pytest.raises(SyncError, match="no anchor marker for version 1"):
        consumer.accept_anchor(1)

    (tmp_path / "anchor_00000002.json").write_text(json.dumps({"version": 3, "epoch": "x", "fingerprint": None}))
    with pytest.raises(SyncError, match="anchor_00000002.json is not an anchor marker of version 2") as exc:
        consumer.poll(2)
    assert exc.value.kind == "anchor"
    (tmp_path / "anchor_00000002.json").write_bytes(b"\xff{")
    with pytest.raises(SyncError, match="anchor_00000002.json: cannot be read as an anchor marker"):
        consumer.anchors()


def test_prune_keeps_the_anchors_a_chaining_consumer_needs_and_clear_removes_all(tmp_path):
    trainer = _Trainer(tmp_path)
    for v in range(6):
        trainer.step(run=1)
        if v in (1, 3):
            trainer.refit({k: t.clone() for k, t in trainer.weights.items()})
    names = lambda: sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("anchor_"))  # noqa: E731
    assert names() == ["anchor_00000000.json", "anchor_00000002.json", "anchor_00000004.json"]
    assert trainer.transport.prune(4) == [1, 2, 3]  # deltas 4.. remain: consumers at >= 3 need the anchor at 2
    assert names() == ["anchor_00000002.json", "anchor_00000004.json"]
    consumer = DirectoryTransport(tmp_path)
    weights = _hf_state()
    for v in range(3):
        apply_delta_(weights, _delta(v, run=1), v)
    engine = ModuleEngine(_HFModule(weights), version=3)
    consumer.accept_anchor(2)  # this consumer verified the anchor at 2 on its way to version 3
    assert consumer.consume(engine) == [4, 5, 6]
    assert trainer.transport.prune(6) == [4, 5]
    assert names() == ["anchor_00000004.json"]
    removed = trainer.transport.clear()
    assert "anchor_00000004.json" in removed and not list(tmp_path.iterdir())
