"""A delta of another run in a delta directory: its versions fit the chain, but it continues another anchor's chain
(the header's ``chain``, the epoch of the producer's newest anchor at or below its base version). The consumer
refuses it naming the file and both epochs and keeps its weights; the trainer's own file back in its place is
followed. A delta used to be applied whenever its base version matched, so the engine silently left the trainer's
weights. Real files, a real :class:`ModuleEngine` and producers driven as ``PolicySync`` drives one."""

from __future__ import annotations

import shutil

import pytest

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError, decode, encode
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.synthetic import random_delta
from megatron_logra.sync.transport import delta_filename
from test_directory_follow_reload import _equal, _Trainer
from test_sync_transport import SHAPE, _hf_state as _state, _HFModule as _HF


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _other_delta(trainer, generator_seed):
    """Publish a delta of ``trainer``'s version that another run would have made (other factors), applied to its
    weights as its own."""
    d = random_delta(SHAPE, 8, base_version=trainer.version, new_version=trainer.version + 1,
                     update_index=trainer.version, seed=3, generator_seed=generator_seed, scale=0.02)
    apply_delta_(trainer.weights, d, trainer.version)
    trainer.t.publish(d)
    trainer.version += 1


def test_a_delta_of_another_run_is_refused_and_the_engine_kept(tmp_path):
    a, b = _Trainer(tmp_path / "a"), _Trainer(tmp_path / "b")
    a.step(3)
    b.step(3)
    consumer, engine = DirectoryTransport(tmp_path / "a"), ModuleEngine(_HF(_state()))
    assert consumer.follow(engine) == [1, 2, 3]
    a.step(1)
    _other_delta(b, generator_seed=100)
    own = tmp_path / "own_delta_4"
    shutil.copy(tmp_path / "a" / delta_filename(4), own)
    shutil.copy(tmp_path / "b" / delta_filename(4), tmp_path / "a" / delta_filename(4))  # copied over by mistake
    epochs = [decode(p.read_bytes()).chain for p in (own, tmp_path / "a" / delta_filename(4))]
    assert None not in epochs and epochs[0] != epochs[1]
    with pytest.raises(SyncError) as exc:
        consumer.follow(engine)
    msg = str(exc.value)
    assert exc.value.kind == "version" and str(tmp_path / "a" / delta_filename(4)) in msg
    assert f"continues the chain of anchor epoch {epochs[1]}" in msg and f"(epoch {epochs[0]})" in msg
    assert "this engine stays at version 3" in msg
    assert engine.weight_version == 3 and _equal(engine, a.at[3])
    shutil.copy(own, tmp_path / "a" / delta_filename(4))  # the trainer's own file back
    assert consumer.follow(engine) == [4] and _equal(engine, a.weights)


def test_each_published_delta_names_the_newest_anchor_below_it(tmp_path):
    trainer = _Trainer(tmp_path)
    trainer.step(2)
    first = DirectoryTransport(tmp_path).anchors()[0]["epoch"]
    trainer.refit()  # at 2: a new epoch
    trainer.step(2)
    second = [m["epoch"] for m in DirectoryTransport(tmp_path).anchors() if m["version"] == 2][0]
    chains = [decode((tmp_path / delta_filename(v)).read_bytes()).chain for v in (1, 2, 3, 4)]
    assert chains == [first, first, second, second] and first != second
    # a delta that names another chain is refused by the producer too
    d = random_delta(SHAPE, 8, base_version=4, new_version=5, update_index=4, seed=3, generator_seed=5)
    d.chain = first
    with pytest.raises(SyncError, match=r"continues the chain of anchor epoch .* runs from epoch"):
        trainer.t.publish(d)


def test_the_chain_survives_encoding_and_a_bad_one_is_refused():
    d = random_delta(SHAPE, 8, base_version=0, new_version=1, update_index=0, seed=3, generator_seed=1)
    assert decode(encode(d)).chain is None
    d.chain = "0123abcd" * 4
    assert decode(encode(d)).chain == d.chain
    for bad in ("", "../x", "a" * 65, 7):
        d.chain = bad
        with pytest.raises(SyncError, match=r"chain=.* must be null or an anchor epoch id"):
            encode(d)
