"""``EmbeddedEngine.apply_sketch_delta``: a commit that fails after some weights were written (an in-place kernel
error; here a weight the kernels cannot write in place, an expanded view whose rows share memory) leaves
``weight_version = -1``, so the same delta is refused instead of being merged a second time into the weights it
already changed, until a full refit sets the version; a delta rejected before its first write leaves the weights
and the version as they were."""

from __future__ import annotations

import pytest
import torch

# Import before initialize_parallel: megatron_logra.cpu_shim's torch.cuda.Stream patch breaks late transformers imports.
from megatron_logra.rollout.embedded import EmbeddedEngine
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.sync import SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.codec import encode
from megatron_logra.sync.synthetic import DenseShape, random_delta

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=64, seq_length=64, init_std=0.1, layernorm_epsilon=1e-5)
SHAPE = DenseShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=64)
BROKEN = "model.layers.1.mlp.down_proj.weight"  # the last weight the commit writes
RANK = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _snapshot(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _equal(engine, reference) -> list[str]:
    """Names of engine tensors that differ (bitwise) from ``reference``."""
    return [n for n, p in engine.model.named_parameters() if not torch.equal(p.detach(), reference[n])]


def _break(engine):
    """Make ``BROKEN`` unwritable in place (every row is row 0); returns its own storage, to restore it."""
    p = dict(engine.model.named_parameters())[BROKEN]
    own = p.data
    p.data = own[:1].expand_as(own)
    return own


def _delta(base, new, seed):
    return random_delta(SHAPE, RANK, base_version=base, new_version=new, update_index=base, generator_seed=seed,
                        scale=0.02)


def test_a_commit_that_fails_part_way_leaves_the_version_unknown_and_a_refit_recovers():
    engine = EmbeddedEngine(CFG, init_seed=3)
    before = _snapshot(engine)
    first = _delta(0, 1, seed=1)
    expected = {n: t.clone() for n, t in before.items()}
    apply_delta_(expected, first, 0)  # the independent reference: the delta applied once to a copy
    assert _equal(engine, expected), "the delta changes the weights"

    own = _break(engine)
    with pytest.raises(SyncError) as exc:
        engine.apply_sketch_delta(encode(first))
    assert exc.value.kind == "apply" and "partially written" in str(exc.value)
    written = [n for n, p in engine.model.named_parameters() if n != BROKEN and not torch.equal(p.detach(), before[n])]
    assert written, "the commit wrote some weights before it failed"
    assert engine.weight_version == -1

    once = _snapshot(engine)
    for retry in (first, encode(first)):  # a retry must not merge the delta a second time
        with pytest.raises(SyncError) as again:
            engine.apply_sketch_delta(retry)
        assert again.value.kind == "gap"
        assert engine.weight_version == -1 and _equal(engine, once) == []
    dict(engine.model.named_parameters())[BROKEN].data = own  # the kernel error is gone: writable again
    with pytest.raises(SyncError) as again:  # still refused: the version is unknown until a full refit
        engine.apply_sketch_delta(first)
    assert again.value.kind == "gap" and engine.weight_version == -1
    assert [n for n in _equal(engine, once) if n != BROKEN] == []

    engine.update_weights_full(expected, 1)  # the full refit to the delta's version
    assert engine.weight_version == 1 and _equal(engine, expected) == []
    second = _delta(1, 2, seed=2)
    apply_delta_(expected, second, 1)
    assert engine.apply_sketch_delta(encode(second)) == 2
    assert _equal(engine, expected) == []


def test_a_rejection_before_any_write_leaves_weights_and_version():
    engine = EmbeddedEngine(CFG, init_seed=4)
    before = _snapshot(engine)
    gap = _delta(3, 4, seed=1)
    nonfinite = _delta(0, 1, seed=2)
    nonfinite.targets[-1].U_OR[0, 0] = float("nan")
    wrong_shape = random_delta(DenseShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=80, vocab=64), RANK,
                               scale=0.02)
    corrupt = bytearray(encode(_delta(0, 1, seed=3)))
    corrupt[len(corrupt) // 2] ^= 1
    for bad, kind in ((gap, "gap"), (nonfinite, "nonfinite"), (wrong_shape, "shape"), (bytes(corrupt), None)):
        with pytest.raises(SyncError) as exc:
            engine.apply_sketch_delta(bad)
        assert kind is None or exc.value.kind == kind, exc.value
        assert engine.weight_version == 0 and _equal(engine, before) == []
    expected = {n: t.clone() for n, t in before.items()}
    good = _delta(0, 1, seed=5)
    apply_delta_(expected, good, 0)
    assert engine.apply_sketch_delta(good) == 1 and _equal(engine, expected) == []
