"""``DirectoryTransport.follow`` as a consumer loop meets a chain it cannot extend by its deltas: a consumer that
fell behind the pruned deltas sees an anchor it cannot follow from, and a delta is missing from the middle of the
chain. Real files, a real :class:`ModuleEngine` and a producer
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
