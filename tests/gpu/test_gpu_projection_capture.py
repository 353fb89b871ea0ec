"""GPU checks: projections are bitwise the same on CUDA and CPU; capture works in bf16 on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megatron_logra.sketch import install_sketches, projection

pytestmark = pytest.mark.gpu


def test_rademacher_projection_bitwise_equal_on_cuda_and_cpu():
    cols = torch.arange(1000, 3000)
    cpu = projection(7, "model.layers.3.mlp.down_proj", 11, 64, 8192, cols=cols)
    gpu = projection(7, "model.layers.3.mlp.down_proj", 11, 64, 8192, cols=cols.cuda(), device="cuda")
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_int32_hash_on_cuda_equals_the_int64_reference(monkeypatch, distribution):
    from megatron_logra.sketch import random_projection as rp

    fast = projection(7, "model.layers.3.mlp.down_proj", 11, 64, 8192, distribution=distribution, device="cuda")
    monkeypatch.setattr(rp, "_fast_path", lambda device: False)  # the int64 arithmetic, no wrap-around
    slow = projection(7, "model.layers.3.mlp.down_proj", 11, 64, 8192, distribution=distribution, device="cuda")
    assert torch.equal(fast, slow)


def test_gaussian_projection_matches_cpu_to_fp32_rounding():
    cpu = projection(7, "x", 0, 32, 4096, distribution="gaussian")
    gpu = projection(7, "x", 0, 32, 4096, distribution="gaussian", device="cuda").cpu()
    # float64 Box-Muller rounded to fp32: CUDA and CPU libm may differ by one fp32 ulp at most
    assert torch.allclose(cpu, gpu, rtol=2e-7, atol=0)


def test_bf16_capture_on_cuda_matches_dense_gradient_projection():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().to(torch.bfloat16)
    dense = copy.deepcopy(model).float()
    sketches = install_sketches(model, ["0", "2"], rank=32, seed=1)
    x = torch.randn(64, 256, device="cuda")
    model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
    dense(x).pow(2).mean().backward()
    for target, layer in zip(sketches.targets, [dense[0], dense[2]]):
        ref = layer.weight.grad @ sketches.projection_for(target).t()
        rel = (target.sketch - ref).norm() / ref.norm()
        assert rel < 5e-2, f"{target.name}: relative error {rel:.3g} (bf16 activations)"
