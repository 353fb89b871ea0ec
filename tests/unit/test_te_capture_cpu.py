"""Capture on the module kinds of the GPU path, checked on CPU.

* TransformerEngine-like modules: torch stand-ins whose classes live in a ``transformer_engine``
  module path (what ``classify_linear`` keys on) and that behave like megatron's TE wrappers
  (``LayerNormLinear``: norm then GEMM, returns ``(out, None)``). The fused module's sketch must be
  ``G·Aᵀ`` with ``G = Hᵀ·norm(x)`` the dense weight gradient (RMSNorm, LayerNorm, zero-centred γ).
* Sequence parallelism on a real gloo TP=2 group with megatron-core's ``ColumnParallelLinear`` /
  ``RowParallelLinear`` (``sequence_parallel=True`` works on CPU for these layers; the local spec's
  norms do not, so a whole GPT cannot run it here), followed by a TE-like replicated ("duplicated")
  linear that sees only its rank's tokens under sequence parallelism: sketches equal ``G·Aᵀ`` of the
  TP=1 dense model, with only ``P`` communicated.

Tolerance: fp32 on both sides, different association only: relative 1e-5 of the sketch's scale.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.layers import classify_linear, normalized_input
from megatron_logra.sketch.random_projection import projection

SEED, RANK = 11, 4


class FakeTELinear(nn.Module):
    """Stand-in for megatron's TELinear (duplicated: no TP): ``(x Wᵀ, None)``."""

    def __init__(self, n_in: int, n_out: int, parallel_mode=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.2)
        self.parallel_mode = parallel_mode

    def forward(self, x):
        return F.linear(x, self.weight), None


class FakeTELayerNormLinear(nn.Module):
    """Stand-in for TELayerNormColumnParallelLinear: ``(norm(x) Wᵀ, None)`` with TE's attributes."""

    def __init__(self, n_in: int, n_out: int, normalization: str, zero_centered_gamma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.2)
        base = 0.0 if zero_centered_gamma else 1.0
        self.layer_norm_weight = nn.Parameter(base + 0.3 * torch.randn(n_in))
        self.layer_norm_bias = nn.Parameter(0.3 * torch.randn(n_in)) if normalization == "LayerNorm" else None
        self.normalization, self.eps, self.zero_centered_gamma = normalization, 1e-5, zero_centered_gamma
        self.parallel_mode = None

    def forward(self, x):
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            y = F.rms_norm(x, (x.shape[-1],), gamma, self.eps)
        else:
            y = F.layer_norm(x, (x.shape[-1],), gamma, self.layer_norm_bias, self.eps)
        return F.linear(y, self.weight), None


FakeTELinear.__module__ = FakeTELayerNormLinear.__module__ = "transformer_engine.pytorch.module.fake"


class Block(nn.Module):
    def __init__(self, normalization: str, zero_centered: bool):
        super().__init__()
        self.linear_qkv = FakeTELayerNormLinear(16, 24, normalization, zero_centered)
        self.linear_proj = FakeTELinear(24, 16)

    def forward(self, x):
        y, _ = self.linear_qkv(x)
        z, _ = self.linear_proj(torch.tanh(y))
        return z


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


# --------------------------------------------------------------------------- sequence parallel over gloo


def init_gloo_tp(rank: int, world: int, init_file: str):
    """A gloo world of ``world`` processes with megatron-core TP = ``world`` on CPU; returns the TP group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron_logra import cpu_shim

    cpu_shim.activate()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return ps.get_tensor_model_parallel_group()


def destroy_gloo_tp() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def parallel_chain(world: int, rank: int, sp: bool, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> nn.Module:
    """``linear_fc1`` (column-parallel, ``w1`` ``[f, h]``) → ``linear_fc2`` (row-parallel, ``w2`` ``[h, f]``) →
    ``out_proj`` (TE-like linear replicated on every TP rank, ``w3`` ``[h, h]``), with or without sequence
    parallelism; each rank holds its shard of the TP=1 weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    f, h = w1.shape
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, tensor_model_parallel_size=world,
                            sequence_parallel=sp, use_cpu_initialization=True, gradient_accumulation_fusion=False)
    block = nn.Module()
    block.linear_fc1 = ColumnParallelLinear(h, f, config=cfg, init_method=nn.init.zeros_, bias=False,
                                            gather_output=False)
    block.linear_fc2 = RowParallelLinear(f, h, config=cfg, init_method=nn.init.zeros_, bias=False,
                                         input_is_parallel=True, skip_bias_add=True)
    block.out_proj = FakeTELinear(h, h)
    block.out_proj.config = cfg
    with torch.no_grad():
        block.linear_fc1.weight.copy_(w1.chunk(world, 0)[rank])
        block.linear_fc2.weight.copy_(w2.chunk(world, 1)[rank])
        block.out_proj.weight.copy_(w3)
    return block


def _sp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    tp = init_gloo_tp(rank, world, init_file)
    h, f, s, b = 16, 32, 8, 2
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(f, h, generator=gen) * 0.3, torch.randn(h, f, generator=gen) * 0.3
    w3 = torch.randn(h, h, generator=gen) * 0.3
    x, target = torch.randn(s, b, h, generator=gen), torch.randn(s, b, h, generator=gen)

    # dense TP=1 reference: G = Hᵀ X of the three layers
    d1, d2, d3 = (w.clone().requires_grad_() for w in (w1, w2, w3))
    dx = x.clone().requires_grad_()
    (F.linear(F.linear(F.gelu(F.linear(dx, d1)), d2), d3) * target).sum().backward()
    out = {}
    for sp in (True, False):
        block = parallel_chain(world, rank, sp, w1, w2, w3)
        ss = install_sketches(block, ["linear_fc1", "linear_fc2", "out_proj"], rank=RANK, seed=SEED, tp_group=tp)
        local = (lambda t: t.chunk(world, 0)[rank]) if sp else (lambda t: t)
        xin = local(x).clone().requires_grad_()
        for _ in range(2):  # two micro-batches accumulate
            y, _ = block.linear_fc1(xin)
            z, _ = block.linear_fc2(F.gelu(y))
            z, _ = block.out_proj(z)
            assert z.shape == local(x).shape
            (z * local(target)).sum().backward()
        ss.reduce_tensor_parallel()
        errs = {}
        for t, dense_grad, rows in ((ss.targets[0], d1.grad, f // world), (ss.targets[1], d2.grad, h),
                                    (ss.targets[2], d3.grad, h)):
            ref = 2 * dense_grad.double() @ projection(SEED, t.name, 0, RANK, t.n_in).double().T
            if t.parallel == "column":
                ref = ref[rank * rows:(rank + 1) * rows]
            errs[t.parallel] = float((t.sketch.double() - ref).abs().max() / ref.abs().max())
            errs[f"{t.parallel}_sp"] = t.sequence_parallel
        errs["dx"] = float((xin.grad - 2 * local(dx.grad)).abs().max())
        out[sp] = errs
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    destroy_gloo_tp()


def test_sequence_parallel_sketches_equal_tp1_dense_gradients_over_gloo():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_sp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for res in results:
        for sp, errs in res.items():
            assert errs["column_sp"] is sp and errs["row_sp"] is sp and errs["none_sp"] is sp
            assert errs["column"] < 1e-5 and errs["row"] < 1e-5 and errs["none"] < 1e-5, (sp, errs)
            assert errs["dx"] < 1e-5, (sp, errs)
