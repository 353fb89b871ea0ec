"""A corrupt anchor marker in a delta directory: one older than the anchor a consumer stands on is never read (it
used to stop every consumer of the directory for good, and a new one could not even reload), one at the
consumer's own anchor is refused naming its path until the trainer's next refit, which ``follow`` reloads. Real
files, a real :class:`ModuleEngine` and a producer driven as ``PolicySync`` drives one."""

from __future__ import annotations

import pytest

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.transport import anchor_filename
from test_directory_follow_reload import _equal, _Trainer
from test_sync_transport import _hf_state as _state, _HFModule as _HF


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _chain(tmp_path):
    """Anchors at 0 and 3 (a refit of the same weights), deltas up to 5; a consumer started from the trainer's
    initial weights follows it to 5, verifying both anchors by fingerprint."""
    trainer = _Trainer(tmp_path)
    trainer.step(3)
    trainer.refit()
    trainer.step(2)
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state()))
    assert consumer.follow(engine) == [1, 2, 3, 4, 5]
    return trainer, consumer, engine


def test_a_corrupt_marker_below_the_consumers_anchor_stops_nobody(tmp_path):
    trainer, consumer, engine = _chain(tmp_path)
    (tmp_path / anchor_filename(0)).write_bytes(b'{"version": 0, "epo')
    trainer.step(2)
    assert consumer.follow(engine) == [6, 7]
    assert _equal(engine, trainer.weights)
    late, fresh = DirectoryTransport(tmp_path), ModuleEngine(_HF(_state(seed=9)))  # a consumer started now
    assert late.follow(fresh) == [4, 5, 6, 7]  # reloads the anchor at 3
    assert _equal(fresh, trainer.weights)


def test_a_corrupt_marker_at_the_consumers_anchor_waits_for_the_next_refit(tmp_path):
    trainer, consumer, engine = _chain(tmp_path)
    marker = tmp_path / anchor_filename(3)
    marker.write_bytes(marker.read_bytes()[:40])
    trainer.step(2)
    for _ in range(2):
        with pytest.raises(SyncError) as exc:
            consumer.follow(engine)
        assert exc.value.kind == "anchor" and engine.weight_version == 5 and _equal(engine, trainer.at[5])
        assert f"{marker}: cannot be read as an anchor marker" in str(exc.value)
        assert "next full refit writes a newer one" in str(exc.value)
    trainer.refit()  # at 7
    trainer.step(1)
    assert consumer.follow(engine) == [8]
    assert engine.weight_version == 8 and _equal(engine, trainer.weights)
