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
from megatron_logra.sync.layout import VOCAB_PARALLEL
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


# ---------------------------------------------------------------------- the model's vocabulary
VOCAB, PADDED = 40, 48  # test_sync_transport's vocabulary, and the trainer's padded one


def _padded(state, rows=PADDED, seed=11):
    """``state`` with ``embed_tokens``/``lm_head`` grown to ``rows`` (the trainer's padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in VOCAB_PARALLEL:
        t = state[name]
        out[name] = torch.cat([t, torch.randn(rows - t.shape[0], *t.shape[1:], generator=gen)])
    return out


def test_the_file_holds_the_model_vocabulary_and_an_engine_of_that_vocabulary_reloads_it(tmp_path):
    trainer = _padded(_hf_state(seed=1))  # what the trainer streams: padded vocabulary rows
    producer = DirectoryTransport(tmp_path)
    producer.write_anchor(3, fingerprint({n: t[:VOCAB] if n in VOCAB_PARALLEL else t for n, t in trainer.items()},
                                         salt=3),
                          full=producer.write_full(3, trainer, vocab_rows=VOCAB))
    with producer.open_full() as reader:
        assert reader.vocab_rows == VOCAB
        assert all(reader.shapes()[n][0] == VOCAB for n in VOCAB_PARALLEL)
    engine = ModuleEngine(_HFModule(_hf_state(seed=2)))  # started from the HF checkpoint: VOCAB rows
    consumer = DirectoryTransport(tmp_path)
    assert consumer.load_full(engine)["version"] == 3 and engine.weight_version == 3
    assert _same(engine, {n: t[:VOCAB] if n in VOCAB_PARALLEL else t for n, t in trainer.items()})
    consumer.verify_anchor(engine)  # the marker's fingerprint covers the file's rows
    assert DirectoryTransport(tmp_path).verify_anchor(engine) is None


def test_an_engine_with_padding_rows_takes_the_vocabulary_as_its_first_rows(tmp_path):
    trainer = _padded(_hf_state(seed=1))
    real = {n: t[:VOCAB] if n in VOCAB_PARALLEL else t for n, t in trainer.items()}
    producer = DirectoryTransport(tmp_path)
    producer.write_anchor(3, fingerprint(real, salt=3), full=producer.write_full(3, trainer, vocab_rows=VOCAB))
    engine = ModuleEngine(_HFModule(_padded(_hf_state(seed=2), seed=12)), vocab_rows=VOCAB)
    padding = {n: engine.weights()[n][VOCAB:].clone() for n in VOCAB_PARALLEL}
    DirectoryTransport(tmp_path).load_full(engine)
    got = engine.weights()
    assert engine.weight_version == 3
    assert all(torch.equal(got[n][:VOCAB] if n in VOCAB_PARALLEL else got[n], t) for n, t in real.items())
    assert all(torch.equal(got[n][VOCAB:], padding[n]) for n in VOCAB_PARALLEL)  # the padding rows stay
    assert engine.fingerprint_vocab_rows == VOCAB and engine.fingerprint() == fingerprint(real, salt=3)
    DirectoryTransport(tmp_path).verify_anchor(engine)  # a restarted consumer verifies by fingerprint


def test_a_file_that_does_not_fit_the_engine_leaves_its_weights_and_version_untouched(tmp_path):
    _anchored(tmp_path, _hf_state(seed=1), 5)
    state = _hf_state(seed=2)
    state["model.norm.weight"] = torch.randn(33)  # near the end of the file: every tensor before it would fit
    engine = ModuleEngine(_HFModule(state), version=2)
    before = _snapshot(engine)
    with pytest.raises(SyncError, match=r"model\.norm\.weight: \(32,\) != \(33,\).*nothing was loaded") as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "shape" and engine.weight_version == 2 and _same(engine, before)
    # more vocabulary rows in the file than the engine holds: refused too, before the first copy
    producer = DirectoryTransport(tmp_path / "padded")
    producer.write_anchor(5, None, full=producer.write_full(5, _padded(_hf_state(seed=1))))
    engine = ModuleEngine(_HFModule(_hf_state(seed=2)), version=2)
    before = _snapshot(engine)
    with pytest.raises(SyncError, match=r"lm_head\.weight: \(48, 32\) != \(40, 32\)") as exc:
        DirectoryTransport(tmp_path / "padded").load_full(engine)
    assert exc.value.kind == "shape" and engine.weight_version == 2 and _same(engine, before)


def test_the_embedded_engine_takes_the_model_vocabulary_into_its_padded_rows_and_refuses_less(tmp_path):
    """The embedded engine holds the padded vocabulary: a file of the model's vocabulary fills its first rows
    (the padding rows stay), a file cut below the model's vocabulary is refused before anything is copied."""
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rollout.embedded import EmbeddedEngine

    cfg = parse_args_to_config("tiny", ["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
                                        f"model.vocab_size={VOCAB}"]).model
    engine = EmbeddedEngine(cfg)
    assert engine.expected_shapes()["model.embed_tokens.weight"][0] == PADDED
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    weights = {n: torch.randn(s) for n, s in engine.expected_shapes().items()}
    short = DirectoryTransport(tmp_path / "short")
    short.write_anchor(1, None, full=short.write_full(1, weights, vocab_rows=VOCAB - 1))
    with pytest.raises(SyncError, match=r"\(39, 32\) != \(48, 32\).*need 40 to 48 rows.*nothing was loaded") as exc:
        DirectoryTransport(tmp_path / "short").load_full(engine)
    assert exc.value.kind == "shape" and engine.weight_version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    producer = DirectoryTransport(tmp_path / "model")
    producer.write_anchor(1, None, full=producer.write_full(1, weights, vocab_rows=VOCAB))
    DirectoryTransport(tmp_path / "model").load_full(engine)
    assert engine.weight_version == 1
    for n, p in engine.model.named_parameters():
        if n in VOCAB_PARALLEL:
            assert torch.equal(p[:VOCAB], weights[n][:VOCAB]) and torch.equal(p[VOCAB:], before[n][VOCAB:]), n
        else:
            assert torch.equal(p, weights[n]), n


class _ListedShapes:
    """An engine that lists its shapes (``expected_shapes``) but has no ``check_full_shapes``."""

    def __init__(self, shapes: dict) -> None:
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}
        self.copied: list[str] = []
        self.weight_version = 0

    def expected_shapes(self) -> dict:
        return {n: tuple(t.shape) for n, t in self.params.items()}

    def update_weights_full(self, stream, version: int) -> None:
        for name, t in stream:
            self.params[name].copy_(t)
            self.copied.append(name)
        self.weight_version = version


def test_an_engine_that_lists_its_shapes_is_checked_exactly_before_anything_is_copied(tmp_path):
    shapes = {"model.embed_tokens.weight": (PADDED, 32), "model.norm.weight": (32,)}
    engine = _ListedShapes(shapes)
    weights = {n: torch.randn(s) for n, s in shapes.items()}
    producer = DirectoryTransport(tmp_path)
    producer.write_anchor(1, None, full=producer.write_full(1, weights, vocab_rows=VOCAB))
    with pytest.raises(SyncError, match=r"does not fit the _ListedShapes.*\(40, 32\) != \(48, 32\).*40 vocabulary "
                                        r"rows.*nothing was loaded") as exc:
        DirectoryTransport(tmp_path).load_full(engine)
    assert exc.value.kind == "shape" and engine.weight_version == 0 and engine.copied == []
    exact = DirectoryTransport(tmp_path / "exact")  # a file of its own shapes loads
    exact.write_anchor(1, None, full=exact.write_full(1, weights))
    exact.load_full(engine)
    assert engine.weight_version == 1 and all(torch.equal(engine.params[n], weights[n]) for n in shapes)
