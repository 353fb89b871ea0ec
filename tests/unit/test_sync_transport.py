"""Transports, the SGLang custom weight loader, fingerprints and the engine-side import boundary.

The SGLang stand-in is a real torch module with SGLang's Llama parameter names and TP shapes
(fused ``qkv_proj``/``gate_up_proj``, row-parallel ``o_proj``/``down_proj``, vocab-parallel
embeddings), sharded here by hand from a full state; the loader's result is compared bitwise
with the HF-layout apply of the same delta, fused and sharded by hand.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_logra.sync import DirectoryTransport, InProcessTransport, ModuleEngine, SyncError, encode
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import combined, drift, fingerprint, sample_rows
from megatron_logra.sync.sglang_loader import (
    TENSOR_NAME,
    delta_as_named_tensors,
    engine_tp,
    engine_version,
    load_sketch_delta,
)
from megatron_logra.sync.synthetic import DenseShape, random_delta
from support.sglang_stand_ins import SGLangQwen2

SHAPE = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40)
RANK = 8
V = 40


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _hf_state(seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=gen) for k, s in SHAPE.hf_shapes().items()}


class _HFModule(nn.Module):
    """Parameters under HF names (a flat holder; ModuleEngine only needs named_parameters)."""

    def __init__(self, state):
        super().__init__()
        self._names = list(state)
        for i, (name, t) in enumerate(state.items()):
            self.register_parameter(f"p{i}", nn.Parameter(t.clone(), requires_grad=False))

    def named_parameters(self, *args, **kwargs):  # HF names
        for i, name in enumerate(self._names):
            yield name, getattr(self, f"p{i}")


def _deltas(n, dense_every=2):
    out = []
    for v in range(n):
        dense = {"model.norm.weight": torch.full((32,), float(v + 1))} if v % dense_every == 0 else {}
        out.append(random_delta(SHAPE, RANK, base_version=v, new_version=v + 1, update_index=v, seed=3,
                                generator_seed=v, scale=0.02, dense=dense))
    return out


# --------------------------------------------------------------------------- in-process


def test_in_process_transport_applies_encoded_deltas_in_order():
    engine = ModuleEngine(_HFModule(_hf_state()))
    reference = _hf_state()
    transport = InProcessTransport(engine)
    for d in _deltas(3):
        assert transport.send(d) == d.new_version
        apply_delta_(reference, d, d.base_version)
    assert engine.weight_version == 3 and transport.num_sent == 3 and transport.bytes_sent > 0
    assert drift(engine.fingerprint(), fingerprint(reference, salt=3)) == []  # the engine salts with its version
    for name, t in engine.weights().items():
        assert torch.equal(t, reference[name]), name
    with pytest.raises(SyncError, match="already applied"):
        transport.send(_deltas(1)[0])


# --------------------------------------------------------------------------- directory


def test_directory_transport_survives_restarts_of_producers_and_consumers(tmp_path):
    deltas = _deltas(5)
    producer_a = DirectoryTransport(tmp_path)
    producer_a.publish(deltas[0])
    producer_a.publish(deltas[1])
    engine_1 = ModuleEngine(_HFModule(_hf_state()))
    engine_2 = ModuleEngine(_HFModule(_hf_state()))
    assert DirectoryTransport(tmp_path).consume(engine_1) == [1, 2]
    producer_b = DirectoryTransport(tmp_path)  # producer restarted (or a second producer)
    producer_b.publish(deltas[2])
    producer_b.publish(encode(deltas[2]))  # re-publishing identical bytes is a no-op
    assert DirectoryTransport(tmp_path).consume(engine_2) == [1, 2, 3]
    consumer_1 = DirectoryTransport(tmp_path)  # consumer restarted: state is the engine's version
    assert consumer_1.consume(engine_1) == [3]
    assert consumer_1.consume(engine_1) == []
    producer_a.publish(deltas[3])
    producer_b.publish(deltas[4])
    assert DirectoryTransport(tmp_path).consume(engine_1) == [4, 5]
    assert DirectoryTransport(tmp_path).consume(engine_2) == [4, 5]
    assert combined(engine_1.fingerprint()) == combined(engine_2.fingerprint())
    for name, t in engine_1.weights().items():
        assert torch.equal(t, engine_2.weights()[name]), name
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert producer_a.versions() == [1, 2, 3, 4, 5]
    assert producer_a.prune(3) == [1, 2] and producer_a.versions() == [3, 4, 5]


def test_directory_transport_refuses_a_different_delta_for_a_published_version(tmp_path):
    transport = DirectoryTransport(tmp_path)
    transport.publish(_deltas(1)[0])
    other = random_delta(SHAPE, RANK, base_version=0, new_version=1, generator_seed=99)
    with pytest.raises(SyncError, match="already holds a different delta") as exc:
        transport.publish(other)
    assert exc.value.kind == "exists"


def test_concurrent_producers_of_one_version_have_one_winner(tmp_path):
    candidates = [random_delta(SHAPE, RANK, base_version=0, new_version=1, generator_seed=s) for s in range(4)]
    results = []

    def publish(delta):
        try:
            DirectoryTransport(tmp_path).publish(delta)
            results.append("ok")
        except SyncError as exc:
            results.append(exc.kind)

    threads = [threading.Thread(target=publish, args=(d,)) for d in candidates]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["exists"] * 3 + ["ok"]
    assert DirectoryTransport(tmp_path).read(1).checksum in {d.checksum for d in candidates}  # set by publish


def test_a_gap_is_rejected_and_leaves_the_engine_untouched(tmp_path):
    deltas = _deltas(4)
    transport = DirectoryTransport(tmp_path)
    engine = ModuleEngine(_HFModule(_hf_state()))
    transport.publish(deltas[0])
    transport.publish(deltas[2])  # version 2 is missing
    transport.publish(deltas[3])
    assert transport.consume(engine) == [1]  # the contiguous prefix
    before = {k: v.clone() for k, v in engine.weights().items()}
    with pytest.raises(SyncError, match=r"versions \(1, 2\] are missing") as exc:
        transport.consume(engine)
    assert exc.value.kind == "gap" and engine.weight_version == 1
    assert all(torch.equal(v, before[k]) for k, v in engine.weights().items())
    transport.publish(deltas[1])  # the missing version arrives: the chain goes on
    assert transport.consume(engine) == [2, 3, 4]


class _LoggingTransport(DirectoryTransport):
    def __init__(self, directory, log):
        super().__init__(directory)
        self.log = log

    def read(self, version):
        self.log.append(f"read {version}")
        return super().read(version)


class _LoggingEngine(ModuleEngine):
    def __init__(self, model, log):
        super().__init__(model)
        self.log = log

    def apply_sketch_delta(self, delta):
        version = super().apply_sketch_delta(delta)
        self.log.append(f"apply {version}")
        return version


def test_consume_applies_file_by_file_and_keeps_the_deltas_before_a_corrupt_one(tmp_path):
    deltas = _deltas(3)
    log = []
    transport = _LoggingTransport(tmp_path, log)
    for d in deltas:
        transport.publish(d)
    path = Path(tmp_path) / "delta_00000003.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    engine = _LoggingEngine(_HFModule(_hf_state()), log)
    with pytest.raises(SyncError, match="delta_00000003.safetensors: .*sha256 mismatch") as exc:
        transport.consume(engine)
    assert exc.value.kind == "checksum"
    assert log == ["read 1", "apply 1", "read 2", "apply 2", "read 3"]  # one file at a time
    assert engine.weight_version == 2
    reference = _hf_state()
    for d in deltas[:2]:
        apply_delta_(reference, d, d.base_version)
    for name, t in engine.weights().items():
        assert torch.equal(t, reference[name]), name


def test_a_file_below_the_chain_is_a_version_error_and_one_above_it_a_gap(tmp_path):
    transport = DirectoryTransport(tmp_path)
    transport.publish(random_delta(SHAPE, RANK, base_version=0, new_version=1))
    transport.publish(random_delta(SHAPE, RANK, base_version=1, new_version=2))
    transport.publish(random_delta(SHAPE, RANK, base_version=1, new_version=3))  # forks from version 1
    with pytest.raises(SyncError, match=r"delta_00000003.safetensors is the delta 1->3 but the chain is already at 2: "
                                         r"it forks from or overlaps the chain") as exc:
        transport.poll(2)
    assert exc.value.kind == "version"
    engine = ModuleEngine(_HFModule(_hf_state()))
    with pytest.raises(SyncError, match="forks from or overlaps") as exc:
        transport.consume(engine)
    assert exc.value.kind == "version" and engine.weight_version == 2

    ahead = DirectoryTransport(tmp_path / "ahead")
    ahead.publish(random_delta(SHAPE, RANK, base_version=0, new_version=1))
    ahead.publish(random_delta(SHAPE, RANK, base_version=2, new_version=3))
    with pytest.raises(SyncError, match=r"delta_00000003.safetensors starts at version 2 but the chain is at 1: "
                                         r"the delta\(s\) for versions \(1, 2\] are missing") as exc:
        ahead.poll(1)
    assert exc.value.kind == "gap"


def test_a_failed_publish_leaves_no_temporary_file(tmp_path, monkeypatch):
    transport = DirectoryTransport(tmp_path)
    delta = _deltas(1)[0]

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as exc:
        transport.publish(delta)
    assert exc.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    transport.publish(delta)
    assert os.listdir(tmp_path) == ["delta_00000001.safetensors"]


# --------------------------------------------------------------------------- SGLang loader


@pytest.mark.parametrize("tp", [1, 2])
def test_sglang_loader_matches_the_hf_apply_sharded_by_hand(tp):
    hf = _hf_state()
    deltas = _deltas(2, dense_every=1)
    deltas[1].dense["lm_head.weight"] = torch.randn(V, 32)
    reference = {k: v.clone() for k, v in hf.items()}
    for d in deltas:
        apply_delta_(reference, d, d.base_version)
    for rank in range(tp):
        model = SGLangQwen2(hf, tp=tp, rank=rank)
        assert engine_tp(model) == (tp, rank) and engine_version(model) == 0
        for d in deltas:
            load_sketch_delta(model, delta_as_named_tensors(d))
        assert engine_version(model) == 2
        expect = dict(SGLangQwen2(reference, tp=tp, rank=rank).named_parameters())
        got = dict(model.named_parameters())
        assert set(got) == set(expect)
        for name in expect:
            assert torch.equal(got[name], expect[name]), f"rank {rank}/{tp}: {name}"


def test_sglang_loader_rejects_without_changes():
    model = SGLangQwen2(_hf_state(), tp=2, rank=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    delta = _deltas(1)[0]
    with pytest.raises(SyncError, match="exactly one tensor named"):
        load_sketch_delta(model, [("model.norm.weight", torch.zeros(32))])
    data = bytearray(encode(delta))
    data[len(data) // 2] ^= 1
    with pytest.raises(SyncError):
        load_sketch_delta(model, [(TENSOR_NAME, torch.frombuffer(data, dtype=torch.uint8))])
    gap = random_delta(SHAPE, RANK, base_version=1, new_version=2)
    with pytest.raises(SyncError, match="skips versions"):
        load_sketch_delta(model, delta_as_named_tensors(gap))
    assert engine_version(model) == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_detects_a_changed_sampled_row_and_is_stable():
    state = _hf_state()
    fp = fingerprint(state)
    assert fp == fingerprint({k: v.clone() for k, v in state.items()})
    name = "model.layers.1.mlp.down_proj.weight"
    row = sample_rows(name, 32)[1]
    changed = {k: v.clone() for k, v in state.items()}
    changed[name][row, 5] = torch.nextafter(changed[name][row, 5], torch.tensor(1e9))  # one ulp
    assert drift(fp, fingerprint(changed)) == [name]
    assert combined(fp) != combined(fingerprint(changed))
    assert drift(fp, {k: v for k, v in fp.items() if k != name}) == [name]
    assert sample_rows(name, 32) == sample_rows(name, 32) and sample_rows(name, 32) != sample_rows("other", 32)


# --------------------------------------------------------------------------- import boundary


_SCRIPT = r"""
import sys
sys.modules["megatron"] = None
sys.modules["transformers"] = None
import torch
import megatron_logra.sync as sync
from megatron_logra.sync.sglang_loader import delta_as_named_tensors, load_sketch_delta, engine_version
from megatron_logra.sync.synthetic import DenseShape, random_delta
shape = DenseShape(hidden=16, layers=1, heads=2, kv_heads=1, ffn=24, vocab=8)
state = {k: torch.randn(*s) for k, s in shape.hf_shapes().items()}
delta = random_delta(shape, 4, dense={"model.norm.weight": torch.ones(16)})
data = sync.encode(delta)
back = sync.decode(data)
weights = {k: v.clone() for k, v in state.items()}
assert sync.apply_delta_(weights, back, 0) == 1
assert not torch.equal(weights["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"])
sync.DirectoryTransport(sys.argv[1]).publish(delta)
assert [d.new_version for d in sync.DirectoryTransport(sys.argv[1]).poll(0)] == [1]
bad = [m for m in sys.modules if m.split(".")[0] in ("megatron", "transformers") and sys.modules[m] is not None]
assert not bad, bad
print("ENGINE-SIDE-OK", sorted(m for m in sys.modules if m.startswith("megatron_logra")))
"""


def test_engine_side_imports_neither_megatron_nor_transformers(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ENGINE-SIDE-OK" in out.stdout
    assert "megatron_logra.sync.trainer" not in out.stdout and "megatron_logra.optim" not in out.stdout
