"""``sglang_loader.load_sketch_delta`` (the raising entry point in-process engines use): a commit that fails after
some weights were written (an in-place kernel error; here a weight the kernels cannot write in place, an expanded
view whose rows share memory) leaves the engine's weight version -1, so the same delta is refused instead of being
merged a second time into the weights it already changed, until a full refit sets the version (``set_version``);
a delta rejected before its first write leaves the weights and the version as they were."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import SyncError
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.codec import encode
from megatron_logra.sync.sglang_loader import (
    TENSOR_NAME,
    command_as_named_tensors,
    delta_as_named_tensors,
    engine_version,
    load_sketch_delta,
    read_state,
    sync_loader,
)
from megatron_logra.sync.synthetic import random_delta
from support.sglang_stand_ins import SHAPE, SGLangQwen2

BROKEN = "model.layers.1.mlp.down_proj.weight"  # the last weight the commit writes
RANK = 8


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _hf_state(seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=gen) for k, s in SHAPE.hf_shapes().items()}


def _delta(base, new, seed):
    return random_delta(SHAPE, RANK, base_version=base, new_version=new, update_index=base, generator_seed=seed,
                        scale=0.02)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _differ(model, reference) -> list[str]:
    """Names of ``reference``'s tensors the model's differ from (bitwise); the model's own record parameters
    (``sync_loader``'s state) are not weights."""
    params = dict(model.named_parameters())
    return [n for n, t in reference.items() if not torch.equal(params[n].detach(), t)]


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_a_commit_that_fails_part_way_leaves_the_version_unknown_until_a_refit(tp, rank):
    hf = _hf_state()
    model = SGLangQwen2(hf, tp=tp, rank=rank)
    model.load_weights(hf.items())
    before = _snapshot(model)
    first, second = _delta(0, 1, seed=1), _delta(1, 2, seed=2)
    reference = {k: v.clone() for k, v in hf.items()}  # the independent reference: the HF weights, deltas applied once
    apply_delta_(reference, first, 0)
    after_first = {k: v.clone() for k, v in reference.items()}
    apply_delta_(reference, second, 1)

    p = dict(model.named_parameters())[BROKEN]
    own = p.data
    p.data = own[:1].expand_as(own)  # every row is row 0: in-place kernels refuse to write it
    with pytest.raises(SyncError) as exc:
        load_sketch_delta(model, delta_as_named_tensors(first))
    assert exc.value.kind == "apply" and "partially written" in str(exc.value)
    assert [n for n in _differ(model, before) if n != BROKEN], "the commit wrote some weights before it failed"
    assert engine_version(model) == -1

    p.data = own  # the kernel error is gone: writable again
    once = _snapshot(model)
    with pytest.raises(SyncError) as again:  # a retry must not merge the delta a second time
        load_sketch_delta(model, delta_as_named_tensors(first))
    assert again.value.kind == "gap" and engine_version(model) == -1 and _differ(model, once) == []

    model.load_weights(after_first.items())  # a full refit (SGLang's default loader), then its version
    sync_loader(model, command_as_named_tensors({"op": "set_version", "version": 1}))
    assert read_state(model)["ok"] and engine_version(model) == 1
    load_sketch_delta(model, delta_as_named_tensors(second))
    assert engine_version(model) == 2
    expect = _snapshot(SGLangQwen2(reference, tp=tp, rank=rank))
    assert _differ(model, expect) == []


def test_a_rejection_before_any_write_leaves_weights_and_version():
    hf = _hf_state()
    model = SGLangQwen2(hf)
    model.load_weights(hf.items())
    before = _snapshot(model)
    nonfinite = _delta(0, 1, seed=2)
    nonfinite.targets[-1].U_OR[0, 0] = float("nan")
    corrupt = bytearray(encode(_delta(0, 1, seed=3)))
    corrupt[len(corrupt) // 2] ^= 1
    requests = [delta_as_named_tensors(_delta(3, 4, seed=1)), delta_as_named_tensors(nonfinite),
                [(TENSOR_NAME, torch.frombuffer(corrupt, dtype=torch.uint8))]]
    for named in requests:
        with pytest.raises(SyncError):
            load_sketch_delta(model, named)
        assert engine_version(model) == 0 and _differ(model, before) == []
    reference = {k: v.clone() for k, v in hf.items()}
    good = _delta(0, 1, seed=5)
    apply_delta_(reference, good, 0)
    load_sketch_delta(model, delta_as_named_tensors(good))
    assert engine_version(model) == 1 and _differ(model, _snapshot(SGLangQwen2(reference))) == []
