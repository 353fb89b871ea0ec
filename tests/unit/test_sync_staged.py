"""Staging a delta apart from its commit (``sync.apply.stage_delta`` / ``StagedDelta.commit_``).

A sharded engine stages on every TP rank, agrees, then commits, so staging must write nothing and
leave nothing for the commit to allocate or check; the commit must give the bits of a one-call apply,
happen at most once, and refuse a stage that the engine's cache has moved past (its fixed-address
inputs then hold another delta). References are fresh one-call applies without a cache on copies.
"""

from __future__ import annotations

import pytest
import torch

import megatron_logra.sync.apply as apply_mod
from megatron_logra.sync.apply import ProjectionCache, apply_delta_, stage_delta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.synthetic import DenseShape, random_delta

SHAPE = DenseShape(hidden=32, layers=2, heads=8, kv_heads=2, ffn=48, vocab=40)
RANK = 8


def _engine(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f in plan_for(random_delta(SHAPE, RANK), "hf", 1, 0).factors:
        out[f.param] = torch.randn(f.U_OR.shape[0], f.n_in, generator=gen).to(dtype)
    out["model.norm.weight"] = torch.ones(SHAPE.hidden, dtype=dtype)
    return out


def _delta(v: int, rounding: str = "nearest", decay: float = 1.0):
    d = random_delta(SHAPE, RANK, base_version=v, new_version=v + 1, seed=5, scale=0.05, generator_seed=v,
                     rounding=rounding, dense={"model.norm.weight": torch.full((SHAPE.hidden,), 1.0 + v / 8)})
    d.decay = decay
    return d


def _snapshot(weights):
    return {k: v.clone() for k, v in weights.items()}


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "stochastic")])
def test_staging_writes_nothing_and_the_commit_equals_a_one_call_apply(dtype, rounding, cuda_graphs):
    weights, ref = _engine(dtype), _engine(dtype)
    cache = ProjectionCache(cuda_graphs=cuda_graphs)
    for v in range(4):
        d = _delta(v, rounding, decay=0.99 if v % 2 else 1.0)
        before = _snapshot(weights)
        staged = stage_delta(weights, d, v, cache=cache)
        assert _equal(weights, before), "staging wrote a weight"
        assert staged.num_tensors == len(weights)
        assert staged.commit_() == v + 1
        assert apply_delta_(ref, d, v) == v + 1
        assert _equal(weights, ref)
        assert not _equal(weights, before)


def test_a_staged_delta_commits_once():
    weights = _engine(torch.float32)
    staged = stage_delta(weights, _delta(0), 0, cache=ProjectionCache())
    staged.commit_()
    after = _snapshot(weights)
    with pytest.raises(SyncError, match="already committed") as err:
        staged.commit_()
    assert err.value.kind == "apply"
    assert _equal(weights, after)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_stage_the_cache_moved_past_is_refused_without_a_write(cuda_graphs):
    weights, ref = _engine(torch.float32), _engine(torch.float32)
    cache = ProjectionCache(cuda_graphs=cuda_graphs)
    first = stage_delta(weights, _delta(0), 0, cache=cache)
    other = _delta(0)
    other.targets[0].U_OR.mul_(2)  # same structure and versions, other numbers: the fixed-address V is refilled
    other.checksum = None
    second = stage_delta(weights, other, 0, cache=cache)
    before = _snapshot(weights)
    with pytest.raises(SyncError, match="stale") as err:
        first.commit_()
    assert err.value.kind == "apply"
    assert _equal(weights, before)
    second.commit_()
    apply_delta_(ref, other, 0)
    assert _equal(weights, ref)


def test_an_allocation_failure_while_staging_is_a_sync_error_with_the_weights_untouched(monkeypatch):
    weights = _engine(torch.bfloat16)
    before = _snapshot(weights)

    def out_of_memory(*args, **kw):
        raise torch.OutOfMemoryError("injected: no room for the workspaces")

    monkeypatch.setattr(apply_mod, "prepare", out_of_memory)
    with pytest.raises(SyncError, match="before any write") as err:
        stage_delta(weights, _delta(0), 0, cache=ProjectionCache())
    assert err.value.kind == "apply"
    assert _equal(weights, before)


@pytest.mark.parametrize("fault,kind", [("nan", "nonfinite"), ("replay", "replay"), ("shape", "shape")])
def test_staging_rejects_what_the_apply_rejects(fault, kind):
    weights, cache = _engine(torch.float32), ProjectionCache()
    stage_delta(weights, _delta(0), 0, cache=cache).commit_()  # the cache now holds this structure
    d = _delta(1) if fault != "replay" else _delta(0)
    if fault == "nan":
        d.targets[1].U_OR[0, 0] = float("nan")
    elif fault == "shape":
        d.dense["model.norm.weight"] = torch.ones(SHAPE.hidden + 1)
    d.checksum = None
    before = _snapshot(weights)
    with pytest.raises(SyncError) as err:
        stage_delta(weights, d, 1, cache=cache)
    assert err.value.kind == kind
    assert _equal(weights, before)


class _NoRoom(torch.Tensor):
    """A dense tensor whose cast to the engine's weight fails as an allocation would."""

    def to(self, *args, **kwargs):
        raise torch.OutOfMemoryError("injected: no room for the dense cast")


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_stage_that_fails_after_refilling_the_inputs_still_retires_the_earlier_one(cuda_graphs):
    """Staging B refills the fixed-address inputs before its dense cast fails: A must not commit B's numbers."""
    weights = _engine(torch.float32)
    cache = ProjectionCache(cuda_graphs=cuda_graphs)
    first = stage_delta(weights, _delta(0), 0, cache=cache)
    other = _delta(0)
    other.targets[0].U_OR.mul_(2)
    other.dense["model.norm.weight"] = other.dense["model.norm.weight"].as_subclass(_NoRoom)
    other.checksum = None
    with pytest.raises(SyncError, match="before any write"):
        stage_delta(weights, other, 0, cache=cache)
    before = _snapshot(weights)
    with pytest.raises(SyncError, match="stale"):
        first.commit_()
    assert _equal(weights, before)
