"""``sglang_loader``'s two entry points, ``load_sketch_delta`` (raises) and ``sync_loader`` (records the outcome
and never raises), apply a delta through one path: fed the same deltas -- accepted, rejected before any write
(non-finite values, a dense entry naming the loader's own record parameter) and one whose commit fails after its
first write -- two engines, one per entry point, hold bitwise the same weights, the same version, the same
attention record, and fail with the same error; accepted deltas leave weights bitwise equal to the trainer's
apply of the same deltas to the Hugging Face state (an independent reference)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from megatron_logra.sync import SyncError
from megatron_logra.sync.sglang_loader import (
    STATE_PARAM,
    command_as_named_tensors,
    delta_as_named_tensors,
    engine_version,
    load_sketch_delta,
    read_state,
    sync_loader,
)
from megatron_logra.sync.sglang_weights import _ATTENTION_ATTR
from megatron_logra.sync.synthetic import random_delta
from support.sglang_stand_ins import SHAPE, SGLangQwen2, delta_chain, hf_state, reference

BROKEN = "model.layers.1.mlp.down_proj.weight"  # the last weight a commit writes


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _weights(model) -> dict[str, torch.Tensor]:
    """The model's weights (its parameters less the loader's record parameters), copied."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("logra_sync_")}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def _by_load(model, delta) -> Optional[SyncError]:
    try:
        load_sketch_delta(model, delta_as_named_tensors(delta))
    except SyncError as exc:
        return exc
    return None


def _by_sync_loader(model, delta) -> Optional[tuple[str, str]]:
    sync_loader(model, delta_as_named_tensors(delta))
    state = read_state(model)
    assert state["op"] == "apply" and state["version"] == engine_version(model)
    return None if state["ok"] else (state["error_kind"], state["error"])


def _both(raising, recording, delta) -> Optional[str]:
    """Apply ``delta`` through each entry point; the two outcomes must be the same (None or one error kind)."""
    error = _by_load(raising, delta)
    recorded = _by_sync_loader(recording, delta)
    if error is None:
        assert recorded is None, f"sync_loader rejected what load_sketch_delta applied: {recorded}"
        return None
    assert recorded == (error.kind, str(error)), "the entry points failed differently"
    return error.kind


def _assert_alike(raising, recording, version: int) -> None:
    assert engine_version(raising) == engine_version(recording) == version
    assert _differ(_weights(raising), _weights(recording)) == []
    assert getattr(raising, _ATTENTION_ATTR, None) == getattr(recording, _ATTENTION_ATTR, None)


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_both_entry_points_leave_the_same_weights_versions_and_records(tp, rank):
    hf = hf_state()
    d1, d2, d3 = delta_chain(3)
    raising, recording = SGLangQwen2(hf, tp=tp, rank=rank), SGLangQwen2(hf, tp=tp, rank=rank)
    for model in (raising, recording):  # a client read the engine's status: the record parameter exists
        sync_loader(model, command_as_named_tensors({"op": "status", "nonce": "n0"}))
        assert read_state(model)["ok"] and engine_version(model) == 0
    assert getattr(raising, _ATTENTION_ATTR, None) is None

    assert _both(raising, recording, d1) is None
    _assert_alike(raising, recording, 1)
    assert _differ(_weights(raising), _weights(SGLangQwen2(reference(hf, [d1]), tp=tp, rank=rank))) == []
    assert getattr(raising, _ATTENTION_ATTR) == SHAPE.attention  # the delta's attention dims are recorded

    # rejected before any write: weights, version and the loader's own record stay as they were
    record = dict(raising.named_parameters())[STATE_PARAM].detach().clone()
    own_record = random_delta(SHAPE, 8, base_version=1, new_version=2, generator_seed=7, scale=2e-3,
                              dense={STATE_PARAM: torch.zeros_like(record)})
    nonfinite = random_delta(SHAPE, 8, base_version=1, new_version=2, generator_seed=8, scale=2e-3)
    nonfinite.targets[0].U_OR[:, 0] = float("inf")  # in every TP rank's share
    after_d1 = _weights(raising)
    for bad, kind in ((own_record, "name"), (nonfinite, "nonfinite")):
        assert _both(raising, recording, bad) == kind
        _assert_alike(raising, recording, 1)
        assert _differ(_weights(raising), after_d1) == []
    assert torch.equal(dict(raising.named_parameters())[STATE_PARAM].detach(), record)

    assert _both(raising, recording, d2) is None
    _assert_alike(raising, recording, 2)
    after_d2 = reference(hf, [d1, d2])
    assert _differ(_weights(recording), _weights(SGLangQwen2(after_d2, tp=tp, rank=rank))) == []

    # a commit that fails after its first write (a weight the in-place kernels cannot write): version -1
    owns = {}
    for model in (raising, recording):
        p = dict(model.named_parameters())[BROKEN]
        owns[model] = p.data
        p.data = p.data[:1].expand_as(p.data)
    assert _both(raising, recording, d3) == "apply"
    for model in (raising, recording):
        dict(model.named_parameters())[BROKEN].data = owns[model]
    _assert_alike(raising, recording, -1)
    assert _differ(_weights(raising), _weights(SGLangQwen2(after_d2, tp=tp, rank=rank))), "nothing was written"
    assert _both(raising, recording, d3) == "gap"  # never merged a second time
    _assert_alike(raising, recording, -1)

    for model in (raising, recording):  # a full refit (SGLang's default loader), then its version
        model.load_weights(after_d2.items())
        sync_loader(model, command_as_named_tensors({"op": "set_version", "version": 2}))
        assert read_state(model)["ok"]
    assert _both(raising, recording, d3) is None
    _assert_alike(raising, recording, 3)
    expect = _weights(SGLangQwen2(reference(hf, [d1, d2, d3]), tp=tp, rank=rank))
    assert _differ(_weights(raising), expect) == [] and _differ(_weights(recording), expect) == []
