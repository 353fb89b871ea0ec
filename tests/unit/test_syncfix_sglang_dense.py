"""Dense q/k/v/o and gate/up/down weights (trained non-targets under a partial ``logra.targets``)
through the SGLang layout at engine TP 1 and 2.

The engine side is played by ``support.sglang_stand_ins`` (SGLang's fused, sharded parameters and
its scheduler); the reference is the same delta applied in the HF layout to HF-named weights
(checked against the checkpoint converter in ``test_sync_layout``), sharded by the stand-in's own
constructor. Every comparison is bitwise.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import SyncError, encode
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.sglang_client import SGLangEngineTarget
from megatron_logra.sync.sglang_loader import FINGERPRINT_PARAM, STATE_PARAM, engine_hf_view
from megatron_logra.sync.synthetic import random_delta
from support.sglang_stand_ins import SHAPE, FakeEngine, SchedulerRuntime, SGLangLlama, hf_state

RANK = 4
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _partial_delta(hf, keep: str, dense_modules, version=0, seed=0):
    """A delta whose LoGRA targets are only the ``keep`` block (``mlp`` or ``self_attn``) and whose
    other block's linear weights travel dense, as ``sync.trainer.build_delta`` sends them."""
    delta = random_delta(SHAPE, RANK, base_version=version, new_version=version + 1, update_index=version, seed=3,
                         generator_seed=seed, scale=2e-3)
    delta.targets = [t for t in delta.targets if f".{keep}." in t.name]
    gen = torch.Generator().manual_seed(100 + seed)
    delta.dense = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16)
                   for k, v in hf.items() if k.rsplit(".", 2)[-2] in dense_modules}
    assert delta.dense and delta.targets
    return delta


def _reference(hf, deltas):
    ref = {k: v.clone() for k, v in hf.items()}
    for d in deltas:
        apply_delta_(ref, d, d.base_version, layout="hf")
    return ref


def _params(model):
    return {n: p for n, p in model.named_parameters() if n not in (STATE_PARAM, FINGERPRINT_PARAM)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("keep,dense_modules", [("mlp", ATTN), ("self_attn", MLP)], ids=["attn-dense", "mlp-dense"])
def test_dense_linear_weights_apply_on_sglang_like_on_hf(tp, keep, dense_modules):
    hf = hf_state()
    runtime = SchedulerRuntime([SGLangLlama(hf, tp=tp, rank=r) for r in range(tp)])
    target = SGLangEngineTarget(FakeEngine(runtime, tp_size=tp))
    deltas = [_partial_delta(hf, keep, dense_modules, version=v, seed=v) for v in range(2)]
    for d in deltas:
        assert target.apply_sketch_delta(encode(d)) == d.new_version  # accepted: no refit needed
    ref = _reference(hf, deltas)
    assert not torch.equal(ref["model.layers.0.self_attn.k_proj.weight" if keep == "mlp" else
                               "model.layers.0.mlp.down_proj.weight"],
                           hf["model.layers.0.self_attn.k_proj.weight" if keep == "mlp" else
                              "model.layers.0.mlp.down_proj.weight"])
    for r in range(tp):  # every rank holds its shard of the reference, bitwise
        got, want = _params(runtime.models[r]), _params(SGLangLlama(ref, tp=tp, rank=r))
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {r}/{tp}: {name}"
    if tp == 1:
        view = engine_hf_view(runtime.models[0])
        for name, w in ref.items():
            assert torch.equal(view[name], w), name


def test_dense_fusing_needs_every_part_and_splittable_columns():
    hf = hf_state()
    delta = _partial_delta(hf, "mlp", ATTN)
    broken = dict(delta.dense)
    del broken["model.layers.0.self_attn.v_proj.weight"]
    delta.dense = broken
    with pytest.raises(SyncError, match=r"\[keys\] fusing model.layers.0.self_attn.qkv_proj.weight needs"):
        plan_for(delta, "sglang", 2, 0)
    delta = _partial_delta(hf, "self_attn", MLP)
    delta.dense = {k: v for k, v in delta.dense.items() if "gate_proj" not in k}
    with pytest.raises(SyncError, match=r"\[keys\] dense model.layers.0.mlp.up_proj.weight present without its "
                                        r"gate_proj.weight"):
        plan_for(delta, "sglang", 1, 0)
    delta = _partial_delta(hf, "self_attn", MLP)
    delta.dense["model.layers.0.mlp.down_proj.weight"] = delta.dense["model.layers.0.mlp.down_proj.weight"][:, :47]
    with pytest.raises(SyncError, match=r"\[layout\] dense model.layers.0.mlp.down_proj.weight \(32, 47\): its "
                                        r"columns do not split over the engine TP size 2"):
        plan_for(delta, "sglang", 2, 0)
    # at TP 2 the o_proj/down_proj entries are this rank's column block, bitwise
    delta = _partial_delta(hf, "self_attn", MLP)
    plan = {d.param: d.tensor for d in plan_for(delta, "sglang", 2, 1).dense}
    down = delta.dense["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(plan["model.layers.1.mlp.down_proj.weight"], down[:, down.shape[1] // 2:])
