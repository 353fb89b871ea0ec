"""The prepared commit an engine's ``ProjectionCache`` keeps across syncs (``sync.prepared``).

A run's deltas share one structure, so after the first sync an engine applies them with the prepared
commit: it must give the same bits as a fresh apply (no cache) for every delta of a sequence, notice a
change of structure or of the engine's weights (and then prepare again, never writing into tensors the
engine no longer uses), and reject every bad delta before a write as the fresh apply does.
"""

from __future__ import annotations

import pytest
import torch

import megatron_logra.sync.apply as apply_mod
from megatron_logra.sync.apply import ProjectionCache, apply_delta_
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.prepared import prepare, structure_key
from megatron_logra.sync.synthetic import DenseShape, random_delta
from tests.support.merge_reference import scaled_factor_reference

SHAPE = DenseShape(hidden=32, layers=2, heads=8, kv_heads=2, ffn=48, vocab=40)
RANK = 8


def _engine(layout: str, tp: int, tp_rank: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    plan = plan_for(random_delta(SHAPE, RANK), layout, tp, tp_rank)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f in plan.factors:
        cols = len(f.cols) if f.cols is not None else f.n_in
        out[f.param] = torch.randn(f.U_OR.shape[0], cols, generator=gen).to(dtype)
    return out


def _deltas(n: int, rounding: str):
    for v in range(n):
        d = random_delta(SHAPE, RANK, base_version=v, new_version=v + 1, seed=5, scale=0.05, generator_seed=v,
                         rounding=rounding)
        d.decay = 1.0 if v % 2 else 0.995
        yield d


@pytest.fixture
def prepares(monkeypatch):
    """The commits ``apply_delta_`` prepares for an engine with a cache (one entry each)."""
    calls = []
    real = apply_mod.prepare

    def counting(*args, **kw):
        if kw.get("cache") is not None:
            calls.append(args[0].new_version)
        return real(*args, **kw)

    monkeypatch.setattr(apply_mod, "prepare", counting)
    return calls


@pytest.mark.parametrize("dtype,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "stochastic"),
                                            (torch.bfloat16, "nearest")])
@pytest.mark.parametrize("layout,tp", [("hf", 1), ("sglang", 2)])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-addresses"])
def test_a_sequence_of_deltas_through_the_cache_equals_fresh_applies_bitwise(prepares, dtype, rounding, layout, tp,
                                                                             static):
    """``static``: the commit a CUDA graph replays (inputs at fixed addresses, the decay a 0-d tensor), run
    eagerly on the CPU."""
    for tp_rank in range(tp):
        prepares.clear()
        cached, fresh = _engine(layout, tp, tp_rank, dtype), _engine(layout, tp, tp_rank, dtype)
        cache, version = ProjectionCache(cuda_graphs=static), 0
        for delta in _deltas(5, rounding):
            before = {k: v.clone() for k, v in cached.items()}
            version = apply_delta_(cached, delta, version, layout=layout, tp_size=tp, tp_rank=tp_rank, cache=cache)
            apply_delta_(fresh, delta, version - 1, layout=layout, tp_size=tp, tp_rank=tp_rank)
            for k in cached:
                assert torch.equal(cached[k], fresh[k]), (k, delta.new_version)
                assert not torch.equal(cached[k], before[k])
        assert version == 5
        assert prepares == [1]  # the first delta's; the other four reuse it


def test_the_factors_of_a_prepared_commit_are_each_engine_weights_own_v():
    """``V`` is computed once per device on the gathered rows of the targets' ``U``: per engine weight it
    must be ``grid(s·U)`` of that weight's own rows (the independent row-by-row reference)."""
    delta = random_delta(SHAPE, RANK, scale=0.05)
    for layout, tp, tp_rank in [("hf", 1, 0), ("sglang", 2, 1), ("sglang", 4, 2)]:
        plan = plan_for(delta, layout, tp, tp_rank)
        weights = _engine(layout, tp, tp_rank, torch.float32)
        prepared = prepare(delta, plan.factors, weights, structure_key(delta, layout, tp, tp_rank, None))
        s = RANK ** -0.5
        for f, V in zip(plan.factors, prepared.factors(delta)):
            assert torch.equal(V.double(), scaled_factor_reference(f.U_OR, float(torch.tensor(s)))), f.param


def test_replaced_weights_or_a_new_structure_are_prepared_again(prepares):
    weights, cache = _engine("hf", 1, 0, torch.float32), ProjectionCache()
    deltas = list(_deltas(3, "nearest"))
    apply_delta_(weights, deltas[0], 0, cache=cache)
    apply_delta_(weights, deltas[1], 1, cache=cache)
    assert prepares == [1]
    # the engine replaced a weight (a reload into new storage; the old tensor must not be written) and
    # switched another to bf16 (its merge needs the fp32 scratch the fp32 weights did not)
    name, other = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"
    old = weights[name]
    weights[name] = old.clone()
    weights[other] = weights[other].to(torch.bfloat16)
    snapshot = old.clone()
    reference = {k: v.clone() for k, v in weights.items()}
    apply_delta_(weights, deltas[2], 2, cache=cache)
    apply_delta_(reference, deltas[2], 2)
    assert prepares == [1, 3]
    assert torch.equal(old, snapshot)
    assert all(torch.equal(weights[k], reference[k]) for k in weights)
    assert not torch.equal(weights[name], snapshot)
    # fewer targets: another structure
    partial = random_delta(SHAPE, RANK, base_version=3, new_version=4, seed=5, layers=[1], generator_seed=9)
    apply_delta_(weights, partial, 3, cache=cache)
    apply_delta_(reference, partial, 3)
    assert prepares == [1, 3, 4]
    assert all(torch.equal(weights[k], reference[k]) for k in weights)


def _nan_in_last_target(delta):
    delta.targets[-1].U_OR[0, 0] = float("nan")
    return delta


@pytest.mark.parametrize("fault,kind", [
    (_nan_in_last_target, "nonfinite"),
    (lambda d: d.__class__(**{**d.__dict__, "base_version": 0, "new_version": 1}), "replay"),
    (lambda d: d.__class__(**{**d.__dict__, "dense": {"model.norm.weight": torch.ones(7)}}), "name"),
])
def test_a_cache_hit_rejects_a_bad_delta_before_any_write(prepares, fault, kind):
    weights, cache = _engine("hf", 1, 0, torch.bfloat16), ProjectionCache()
    deltas = list(_deltas(3, "stochastic"))
    apply_delta_(weights, deltas[0], 0, cache=cache)
    apply_delta_(weights, deltas[1], 1, cache=cache)
    snapshot = {k: v.clone() for k, v in weights.items()}
    with pytest.raises(SyncError) as err:
        apply_delta_(weights, fault(deltas[2]), 2, cache=cache)
    assert err.value.kind == kind
    assert len(prepares) == 1  # the rejection came from the kept commit's path
    assert all(torch.equal(weights[k], snapshot[k]) for k in weights)
    if kind == "nonfinite":
        assert deltas[2].targets[-1].name in str(err.value)
