"""``DirectoryTransport.follow`` as a consumer loop meets a chain it cannot extend by its deltas: a delta file that
is corrupt (or holds another version) stays in the directory for good, and a consumer that fell behind the
pruned deltas sees an anchor it cannot follow from. Real files, a real :class:`ModuleEngine` and a producer
driven as ``PolicySync`` drives one (a refit writes full weights and an anchor, each update publishes a delta)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.synthetic import random_delta
from megatron_logra.sync.transport import delta_filename
from test_sync_transport import SHAPE, _hf_state as _state, _HFModule as _HF


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class _Trainer:
    """A producer: a refit (full weights + anchor) at its first version, then one published delta per update."""

    def __init__(self, directory, version=0):
        self.t = DirectoryTransport(directory)
        self.weights, self.version = _state(), version
        self.at = {}
        self.refit()

    def refit(self):
        full = self.t.write_full(self.version, self.weights)
        self.t.write_anchor(self.version, fingerprint(self.weights, salt=self.version), full=full)
        self.at[self.version] = {k: v.clone() for k, v in self.weights.items()}

    def step(self, n=1):
        for _ in range(n):
            d = random_delta(SHAPE, 8, base_version=self.version, new_version=self.version + 1,
                             update_index=self.version, seed=3, generator_seed=self.version, scale=0.02)
            apply_delta_(self.weights, d, self.version)
            self.t.publish(d)
            self.version += 1
            self.at[self.version] = {k: v.clone() for k, v in self.weights.items()}


def _equal(engine, weights):
    return all(torch.equal(t, weights[name]) for name, t in engine.weights().items())


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_delta_is_refused_until_a_newer_anchor_is_reloaded_past_it(tmp_path):
    """A flipped byte in delta 5 is refused with the file's path and what to do, the engine left at 4; once the
    trainer refits at 6, follow() reloads those weights and goes on (it used to raise the checksum error at every
    poll for as long as the file was there, though the full weights past it were in the directory)."""
    trainer = _Trainer(tmp_path)
    trainer.step(3)
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state(seed=9)))
    assert consumer.follow(engine) == [1, 2, 3]
    trainer.step(3)
    _corrupt(tmp_path / delta_filename(5))
    for _ in range(2):
        with pytest.raises(SyncError) as exc:
            consumer.follow(engine)
        assert exc.value.kind == "checksum" and engine.weight_version == 4 and _equal(engine, trainer.at[4])
        message = str(exc.value)
        assert str(tmp_path / delta_filename(5)) in message and "stays at version 4" in message
        assert "put the trainer's own delta_00000005.safetensors back" in message and "full refit" in message

    trainer.refit()  # at 6, past the corrupt file
    trainer.step(2)
    with pytest.raises(SyncError, match=r"newest anchor \(version 6\) is past it: follow\(engine\) reloads"):
        consumer.consume(engine)  # consume alone does not reload, and says that follow would
    assert consumer.follow(engine) == [7, 8]
    assert engine.weight_version == 8 and _equal(engine, trainer.weights)
    assert consumer.follow(engine) == []


def test_a_delta_holding_another_version_is_passed_by_reloading_a_newer_anchor(tmp_path):
    """A delta of another version copied over delta 3 (a replayed file): refused naming both versions, then
    passed by reloading the anchor the trainer wrote after it."""
    trainer = _Trainer(tmp_path)
    trainer.step(4)
    (tmp_path / delta_filename(3)).write_bytes((tmp_path / delta_filename(2)).read_bytes())
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state(seed=9)))
    with pytest.raises(SyncError, match=r"delta_00000003\.safetensors holds the delta 1->2, not version 3") as exc:
        consumer.follow(engine)  # reloads the anchor at 0, applies 1 and 2, refuses 3
    assert exc.value.kind == "version" and engine.weight_version == 2 and _equal(engine, trainer.at[2])
    trainer.refit()
    trainer.step(1)
    assert consumer.follow(engine) == [5]
    assert _equal(engine, trainer.weights)


def test_a_consumer_behind_the_pruned_deltas_keeps_its_weights_until_a_reachable_anchor(tmp_path):
    """An engine started from the trainer's initial weights (the anchor at 0 verified by fingerprint) falls behind
    the pruned deltas: reloading that anchor cannot get it back on the chain, so follow() leaves it at version 2
    (it used to reload version 0's weights and then fail at the gap, serving older weights than it had); the
    trainer's next refit is reloaded."""
    trainer = _Trainer(tmp_path)
    trainer.step(2)
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state()))
    assert consumer.follow(engine) == [1, 2]
    trainer.step(4)
    assert trainer.t.prune(4) == [1, 2, 3]
    for _ in range(2):
        with pytest.raises(SyncError, match=r"older than the deltas left \(the oldest is "
                                            r"delta_00000004\.safetensors\).*next full refit") as exc:
            consumer.follow(engine)
        assert exc.value.kind == "gap"
        assert engine.weight_version == 2 and _equal(engine, trainer.at[2])
    trainer.refit()
    trainer.step(1)
    assert consumer.follow(engine) == [7]
    assert engine.weight_version == 7 and _equal(engine, trainer.weights)


def test_a_hole_in_the_chain_names_no_anchor_that_cannot_be_followed(tmp_path):
    """A delta removed from the middle of the chain: the gap says the missing file will not come and does not
    advise reloading the anchor at 0, whose chain runs into the same hole."""
    trainer = _Trainer(tmp_path)
    trainer.step(5)
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state(seed=9)))
    consumer.load_full(engine)
    assert consumer.consume(engine) == [1, 2, 3, 4, 5]
    (tmp_path / delta_filename(3)).unlink()
    with pytest.raises(SyncError, match=r"versions \(2, 3\] are missing \(removed from .*"
                                        r"hole in the deltas \(delta_00000003\.safetensors is missing\)"):
        DirectoryTransport(tmp_path).poll(2)


def test_full_weights_the_engine_cannot_hold_are_not_reread_at_every_poll(tmp_path):
    """An engine without one of the trainer's tensors stops at a corrupt delta; the newest anchor's file is tried
    once and refused by shape, and the next polls raise the delta's own error without reading the model-sized
    file again (here it is corrupted after the first try: a second read would fail on its checksum instead)."""
    trainer = _Trainer(tmp_path)
    trainer.step(4)
    trainer.refit()
    partial = {k: v.clone() for k, v in trainer.at[0].items() if k != "model.norm.weight"}
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(partial))
    consumer.accept_anchor(0)  # this engine was loaded with the trainer's weights by other means
    _corrupt(tmp_path / delta_filename(3))
    with pytest.raises(SyncError, match=r"model\.norm\.weight") as exc:
        consumer.follow(engine)
    assert exc.value.kind == "shape" and engine.weight_version == 2
    _corrupt(tmp_path / "full_00000004.safetensors")
    for _ in range(2):
        with pytest.raises(SyncError, match=r"delta_00000003\.safetensors: sha256 mismatch") as exc:
            consumer.follow(engine)
        assert exc.value.kind == "checksum" and engine.weight_version == 2
