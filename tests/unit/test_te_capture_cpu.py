"""Capture on the module kinds of the GPU path, checked on CPU.

* TransformerEngine-like modules: torch stand-ins whose classes live in a ``transformer_engine``
  module path (what ``classify_linear`` keys on) and that behave like megatron's TE wrappers
  (``LayerNormLinear``: norm then GEMM, returns ``(out, None)``). The fused module's sketch must be
  ``G·Aᵀ`` with ``G = Hᵀ·norm(x)`` the dense weight gradient (RMSNorm, LayerNorm, zero-centred γ).
* Sequence parallelism on a real gloo TP=2 group: ``tests/distributed/test_te_tp_gloo.py``.

Tolerance: fp32 on both sides, different association only: relative 1e-5 of the sketch's scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.layers import classify_linear, normalized_input
from megatron_logra.sketch.random_projection import projection
from support.te_stand_ins import Block, FakeTELayerNormLinear, FakeTELinear

SEED, RANK = 11, 4


def test_te_modules_are_classified_without_importing_te():
    qkv = FakeTELayerNormLinear(8, 8, "RMSNorm")
    info = classify_linear(qkv, None, "qkv")
    assert (info.backend, info.parallel, info.fused_norm, info.sequence_parallel) == ("transformer_engine", "none", True, False)
    info = classify_linear(FakeTELinear(8, 4, parallel_mode="column"), None, "fc1")
    assert (info.parallel, info.fused_norm, info.n_in) == ("column", False, 8)
    with pytest.raises(ValueError, match="parallel_mode"):
        classify_linear(FakeTELinear(8, 4, parallel_mode="sideways"), None, "x")


@pytest.mark.parametrize("normalization,zero_centered", [("RMSNorm", False), ("RMSNorm", True), ("LayerNorm", False)])
def test_normalized_input_matches_torch_norm(normalization, zero_centered):
    m = FakeTELayerNormLinear(32, 8, normalization, zero_centered)
    x = torch.randn(5, 3, 32) * 3 + 1
    gamma = m.layer_norm_weight + 1 if zero_centered else m.layer_norm_weight
    if normalization == "RMSNorm":
        ref = F.rms_norm(x, (32,), gamma, m.eps)
    else:
        ref = F.layer_norm(x, (32,), gamma, m.layer_norm_bias, m.eps)
    torch.testing.assert_close(normalized_input(m, x), ref.detach(), rtol=1e-5, atol=1e-6)
    assert normalized_input(m, x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("normalization,zero_centered", [("RMSNorm", False), ("RMSNorm", True), ("LayerNorm", False)])
def test_fused_norm_sketch_equals_dense_gradient_times_projection(normalization, zero_centered):
    torch.manual_seed(0)
    dense = Block(normalization, zero_centered)
    model = copy.deepcopy(dense)
    ss = install_sketches(model, ["linear_qkv", "linear_proj"], rank=RANK, seed=SEED)
    assert [t.fused_norm for t in ss.targets] == [True, False]
    x = torch.randn(2, 6, 16)
    for xi in (x, x * 2 - 1):  # two micro-batches accumulate
        xa, xb = xi.clone().requires_grad_(), xi.clone().requires_grad_()
        model(xa).square().sum().backward()
        dense(xb).square().sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)  # input gradients are dense training's
    for t in ss.targets:
        grad = dense.get_submodule(t.module_name).weight.grad
        ref = grad.double() @ projection(SEED, t.name, 0, RANK, t.n_in).double().T
        err = (t.sketch.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, f"{t.module_name}: relative error {float(err):.2e}"
    # the norm parameters still train (they are not targets)
    assert model.linear_qkv.layer_norm_weight.grad is not None
