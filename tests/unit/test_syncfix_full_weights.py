"""The directory transport's full-weights files: what a separate engine reloads after a trainer refit
(re-anchor, drift repair, resume) or after the deltas it needed were pruned, so it can rejoin the chain.

Real files, real ``ModuleEngine``s and ``apply_delta_`` on both sides; ``safetensors`` reads the files too."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_logra.sync import DirectoryTransport, ModuleEngine, SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.transport import full_filename
from test_sync_transport import _hf_state, _HFModule
from test_syncfix_directory_anchor import _delta


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _equal(engine, weights):
    got = engine.weights()
    assert set(got) == set(weights)
    for name, t in weights.items():
        assert torch.equal(got[name], t.to(got[name].dtype)), name


class _Trainer:
    """The producer side as PolicySync drives it: deltas, and at each refit full weights + an anchor."""

    def __init__(self, directory):
        self.weights, self.version = _hf_state(), 0
        self.transport = DirectoryTransport(directory)
        self.refit(self.weights)

    def step(self):
        d = _delta(self.version, run=1)
        self.transport.publish(d)
        apply_delta_(self.weights, d, self.version)
        self.version += 1

    def refit(self, weights):
        self.weights = weights
        full = self.transport.write_full(self.version, self.weights)
        assert full == {"file": full_filename(self.version), "sha256": full["sha256"]}
        self.transport.write_anchor(self.version, fingerprint(self.weights, salt=self.version), full=full)


def test_a_refit_outside_the_chain_is_reloaded_from_its_file_and_the_engine_rejoins(tmp_path):
    trainer = _Trainer(tmp_path)
    consumer, engine = DirectoryTransport(tmp_path), ModuleEngine(_HFModule(_hf_state()))
    trainer.step()
    assert consumer.consume(engine) == [1]
    trainer.step()
    trainer.refit({k: v * 1.5 for k, v in trainer.weights.items()})  # a master re-anchor at version 2
    trainer.step()
    with pytest.raises(SyncError, match=r"differ from the trainer's anchor .* reload the trainer's full weights at "
                                        r"version 2 from .*full_00000002\.safetensors with "
                                        r"DirectoryTransport\.load_full\(engine\)") as exc:
        consumer.consume(engine)
    assert exc.value.kind == "anchor" and engine.weight_version == 2
    assert consumer.load_full(engine)["version"] == 2 and engine.weight_version == 2
    assert consumer.consume(engine) == [3]
    _equal(engine, trainer.weights)
    # only the newest anchor's file is kept; safetensors reads it as an ordinary file
    assert trainer.transport.full_files() == [2]
    on_disk = load_file(str(tmp_path / full_filename(2)))
    assert set(on_disk) == set(trainer.weights)


def test_a_consumer_past_an_unverified_anchor_reloads_the_newest_file(tmp_path):
    """A restarted consumer (new transport object) ahead of the newest anchor rejoins by reloading it."""
    trainer = _Trainer(tmp_path)
    first, engine = DirectoryTransport(tmp_path), ModuleEngine(_HFModule(_hf_state()))
    for _ in range(3):
        trainer.step()
    assert first.consume(engine) == [1, 2, 3]
    restarted = DirectoryTransport(tmp_path)
    trainer.step()
    with pytest.raises(SyncError, match=r"passed without verifying.*full_00000000\.safetensors"):
        restarted.consume(engine)
    restarted.load_full(engine)  # back to version 0, then along the chain
    assert engine.weight_version == 0 and restarted.consume(engine) == [1, 2, 3, 4]
    _equal(engine, trainer.weights)


def test_a_consumer_behind_pruned_deltas_is_told_they_are_gone_and_rejoins(tmp_path):
    trainer = _Trainer(tmp_path)
    behind = ModuleEngine(_HFModule(_hf_state()))
    consumer = DirectoryTransport(tmp_path)
    for _ in range(2):
        trainer.step()
    trainer.refit({k: v.clone() for k, v in trainer.weights.items()})  # anchor_interval at version 2
    for _ in range(4):
        trainer.step()
    trainer.transport.prune(5)  # keep_deltas: deltas 5, 6 remain; the anchor at 2 (and its file) too
    assert trainer.transport.versions() == [5, 6] and trainer.transport.full_files() == [2]
    with pytest.raises(SyncError, match=r"versions \(0, 4\] are no longer in .*pruned, sync.keep_deltas, or removed "
                                        r"by a trainer restart.*the newest anchor's weights \(version 2\) are older "
                                        r"than the deltas left .*reload at the producer's next full refit") as exc:
        consumer.consume(behind)
    assert exc.value.kind == "gap" and behind.weight_version == 0
    trainer.refit({k: v.clone() for k, v in trainer.weights.items()})  # the next refit, at version 6
    trainer.step()
    with pytest.raises(SyncError, match=r"no longer in .*reload the trainer's full weights at version 6 from "
                                        r".*full_00000006\.safetensors with DirectoryTransport\.load_full"):
        consumer.consume(behind)
    consumer.load_full(behind)
    assert consumer.consume(behind) == [7]
    _equal(behind, trainer.weights)


def test_clear_above_a_resume_version_keeps_the_files_up_to_it(tmp_path):
    trainer = _Trainer(tmp_path)
    behind = ModuleEngine(_HFModule(_hf_state()))
    for _ in range(5):
        trainer.step()
    removed = trainer.transport.clear(above_version=3)  # the trainer resumes from its checkpoint of version 3
    assert sorted(removed) == ["delta_00000004.safetensors", "delta_00000005.safetensors"]
    assert trainer.transport.versions() == [1, 2, 3] and trainer.transport.full_files() == [0]
    assert DirectoryTransport(tmp_path).consume(behind) == [1, 2, 3]  # still the same trajectory up to 3
    assert sorted(trainer.transport.clear()) == ["anchor_00000000.json", "delta_00000001.safetensors",
                                                 "delta_00000002.safetensors", "delta_00000003.safetensors",
                                                 "full_00000000.safetensors"]


def test_a_corrupt_or_replaced_file_is_refused_before_the_engine_is_touched(tmp_path):
    trainer = _Trainer(tmp_path)
    engine = ModuleEngine(_HFModule(_hf_state(seed=4)), version=0)
    before = {k: v.clone() for k, v in engine.weights().items()}
    path = tmp_path / full_filename(0)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(SyncError, match="sha256 mismatch") as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "checksum"
    path.write_bytes(bytes(data[:-7]))
    with pytest.raises(SyncError) as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "truncated"
    # a valid file that is not the one the marker names (another trajectory's weights at that version)
    DirectoryTransport(tmp_path / "other").write_full(0, _hf_state(seed=9))
    os.replace(tmp_path / "other" / full_filename(0), path)
    with pytest.raises(SyncError, match="is not the file of this anchor") as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "anchor"
    _equal(engine, before)
    os.remove(path)
    with pytest.raises(SyncError, match="cannot be read") as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "unreadable"
    trainer.transport.write_anchor(0, None)  # an anchor without a file
    with pytest.raises(SyncError, match="has no full-weights file") as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "anchor"
    _equal(engine, before)


def test_the_writer_streams_in_declared_order_and_leaves_nothing_behind_on_failure(tmp_path):
    transport = DirectoryTransport(tmp_path)
    state = {"a": torch.randn(3, 4), "b": torch.randn(5), "c": torch.tensor(2.0), "e": torch.zeros(0, 4)}
    specs = [(n, list(t.shape)) for n, t in state.items()]
    writer = transport.full_writer(4, specs, torch.bfloat16)
    writer.add("a", state["a"])
    writer.add("c", state["c"])  # out of order: the file is lost, the stream is not interrupted
    writer.add("b", state["b"])
    assert writer.finish() is None and writer.error and "where b" in writer.error
    assert os.listdir(tmp_path) == []
    writer = transport.full_writer(4, specs, torch.bfloat16)
    writer.add("a", state["a"])
    assert writer.finish() is None and os.listdir(tmp_path) == []  # tensors never came
    full = transport.write_full(4, state, torch.bfloat16)
    transport.write_anchor(4, None, full=full)
    with transport.open_full() as reader:
        got = dict(reader.tensors())
    assert list(got) == list(state) and all(torch.equal(got[k], v.bfloat16()) for k, v in state.items())
    assert json.loads((tmp_path / "anchor_00000004.json").read_text())["full"] == full
    with pytest.raises(SyncError, match="full weights"):
        transport.write_anchor(4, None, full={"file": full_filename(3), "sha256": full["sha256"]})


def test_a_sharded_engine_cannot_take_full_hf_tensors(tmp_path):
    from support.sglang_stand_ins import SGLangQwen2

    trainer = _Trainer(tmp_path)
    sglang = ModuleEngine(SGLangQwen2(_hf_state(), tp=2, rank=0), layout="sglang", tp_size=2, tp_rank=0)
    with pytest.raises(SyncError) as exc:
        DirectoryTransport(tmp_path).load_full(sglang)
    assert exc.value.kind == "layout" and sglang.weight_version == 0
    assert trainer.transport.full_files() == [0]


def test_a_full_weights_file_that_cannot_be_written_is_lost_without_interrupting_the_stream(tmp_path, monkeypatch):
    transport = DirectoryTransport(tmp_path)
    real_open = open

    def full_disk(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    writer = transport.full_writer(1, [("a", [2, 2])], torch.float32)
    writer.add("a", torch.ones(2, 2))
    assert writer.finish() is None and "No space left" in writer.error
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    # the tensors load into safetensors too, 0-d and empty ones included
    state = {"s": torch.tensor(3.0), "e": torch.zeros(0, 2), "v": torch.arange(4.0)}
    transport.write_full(2, state)
    got = load_file(str(tmp_path / full_filename(2)))
    assert all(torch.equal(got[k], v) for k, v in state.items())
