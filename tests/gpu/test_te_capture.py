"""TransformerEngine path on GPUs: sketches of TE linears equal ``G·Aᵀ`` of the dense gradient.

For every TE module kind megatron builds (``TELayerNormColumnParallelLinear``,
``TEColumnParallelLinear``, ``TERowParallelLinear``, ``TELinear`` duplicated) and for a TE-spec
GPT: a frozen model with sketches and an unfrozen twin with the same weights run the same batch;
each sketch must equal ``G·Aᵀ`` with ``G`` the twin's autograd weight gradient (row-parallel and
sequence-parallel replicated layers: summed over TP). fp32 parameters; TE's fp32 GEMMs may run in
TF32, so the tolerance is relative 5e-3. Sequence parallelism needs TP >= 2, so those cases run
only with two or more GPUs (NCCL, one process per GPU). The FP8 projection, which needs no TE, is
in ``test_fp8_projection.py``.

Skipped without CUDA or without transformer_engine.
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from megatron_logra.models.te import te_installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and transformer_engine"),
]

SEED, RANK, TOL = 5, 16, 5e-3
H, FF, S, B = 128, 256, 64, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _te_chain(cfg, tp_group):
    """x -> LN-fused column (qkv) -> gelu -> row (proj) -> column (fc1) -> gelu -> row (fc2) -> duplicated."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear, TELayerNormColumnParallelLinear, TELinear, TERowParallelLinear,
    )

    init = nn.init.zeros_
    m = nn.Module()
    common = dict(config=cfg, init_method=init, bias=False, skip_bias_add=False, is_expert=False, tp_group=tp_group)
    m.linear_qkv = TELayerNormColumnParallelLinear(H, FF, gather_output=False, **common)
    m.linear_proj = TERowParallelLinear(FF, H, input_is_parallel=True, **common)
    m.linear_fc1 = TEColumnParallelLinear(H, FF, gather_output=False, **common)
    m.linear_fc2 = TERowParallelLinear(FF, H, input_is_parallel=True, **common)
    m.out_proj = TELinear(H, H, parallel_mode="duplicated", config=cfg, init_method=init, bias=False,
                          skip_bias_add=False, skip_weight_param_allocation=False)
    return m.cuda()


def _chain_forward(m, x):
    y, _ = m.linear_qkv(x)
    z, _ = m.linear_proj(F.gelu(y))
    y, _ = m.linear_fc1(z)
    z, _ = m.linear_fc2(F.gelu(y))
    out, _ = m.out_proj(z)
    return out


def _check_sketches(ss, dense: nn.Module, tp_group) -> dict:
    """Relative error of every sketch against the twin's dense gradient times ``Aᵀ``."""
    from megatron_logra.sketch.random_projection import projection

    errs = {}
    for t in ss.targets:
        grad = dense.get_submodule(t.module_name).weight.grad.double()
        proj = projection(SEED, t.name, 0, RANK, t.n_in, cols=t.cols, device="cuda").double()
        ref = grad @ proj.T
        if t.partial and tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(ref, group=tp_group)
        errs[f"{t.module_name}:{type(t.module).__name__}:sp={t.sequence_parallel}"] = \
            float((t.sketch.double() - ref).abs().max() / ref.abs().max())
    return errs


def _chain_worker(rank: int, world: int, port: int, sp: bool, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.sketch.capture import install_sketches

    groups = initialize_parallel(ParallelConfig(tp=world, backend="nccl"), seed=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, tensor_model_parallel_size=world,
                            sequence_parallel=sp, normalization="RMSNorm", params_dtype=torch.float32,
                            gradient_accumulation_fusion=False)
    model, dense = _te_chain(cfg, groups.tp), _te_chain(cfg, groups.tp)
    gen = torch.Generator(device="cuda").manual_seed(rank)  # TP shards differ per rank, twins agree
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.05 + (1.0 if p.dim() == 1 else 0.0))
        if world > 1:  # replicated parameters must agree over TP
            for name, p in model.named_parameters():
                if not getattr(p, "tensor_model_parallel", False):
                    dist.broadcast(p, src=dist.get_global_rank(groups.tp, 0), group=groups.tp)
        dense.load_state_dict(model.state_dict())
    ss = install_sketches(model, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "out_proj"], rank=RANK,
                          seed=SEED, tp_group=groups.tp)
    x_gen = torch.Generator(device="cuda").manual_seed(99)
    x = torch.randn(S, B, H, generator=x_gen, device="cuda")
    target = torch.randn(S, B, H, generator=x_gen, device="cuda")
    local = (lambda t: t.chunk(world, 0)[groups.tp_rank]) if sp else (lambda t: t)
    for net in (model, dense):
        xin = local(x).clone().requires_grad_()
        (_chain_forward(net, xin) * local(target)).sum().backward()
    ss.reduce_tensor_parallel()
    torch.save(_check_sketches(ss, dense, groups.tp), os.path.join(result_dir, f"rank{rank}.pt"))
    destroy_parallel()


def _run_chain(world: int, sp: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_chain_worker, args=(world, _free_port(), sp, tmp), nprocs=world, join=True)
        return {r: torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)}


def test_te_module_kinds_sketch_equals_dense_gradient_times_projection():
    for rank, errs in _run_chain(1, sp=False).items():
        assert len(errs) == 5
        assert all(e < TOL for e in errs.values()), errs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="sequence parallelism needs TP >= 2 (two GPUs)")
@pytest.mark.parametrize("sp", [False, True])
def test_te_module_kinds_at_tp2_with_and_without_sequence_parallel(sp):
    for rank, errs in _run_chain(2, sp=sp).items():
        assert all(f"sp={sp}" in k for k in errs if "out_proj" not in k)
        assert all(e < TOL for e in errs.values()), (rank, errs)


def test_te_spec_gpt_sketches_equal_dense_gradients():
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.sketch.capture import install_sketches

    groups = initialize_parallel(ParallelConfig(), seed=1)
    try:
        cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256,
                          seq_length=64, transformer_impl="transformer_engine")
        model, dense = build_gpt(cfg, groups, seed=3), build_gpt(cfg, groups, seed=3)
        kinds = {type(m).__name__ for m in model.modules()}
        assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear"} <= kinds
        ss = install_sketches(model, rank=RANK, seed=SEED, tp_group=groups.tp)
        assert sum(t.fused_norm for t in ss.targets) == 4  # linear_qkv and linear_fc1 of both layers
        tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        pos = torch.arange(64, device="cuda")[None].expand(2, -1)
        for net in (model, dense):
            net(tokens, pos, None, labels=tokens).float().sum().backward()
        errs = _check_sketches(ss, dense, groups.tp)
        assert len(errs) == 8 and all(e < TOL for e in errs.values()), errs
    finally:
        destroy_parallel()


def test_fp8_te_gpt_trains_with_finite_sketches():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.sketch.capture import install_sketches

    groups = initialize_parallel(ParallelConfig(), seed=1)
    try:
        cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256,
                          seq_length=64, params_dtype="bfloat16", transformer_impl="transformer_engine", fp8="hybrid")
        model = build_gpt(cfg, groups, seed=3)
        ss = install_sketches(model, rank=RANK, seed=SEED, tp_group=groups.tp)
        tokens = torch.randint(0, 256, (2, 64), device="cuda")
        pos = torch.arange(64, device="cuda")[None].expand(2, -1)
        model(tokens, pos, None, labels=tokens).float().sum().backward()
        assert bool(torch.isfinite(ss.flat).all()) and float(ss.flat.abs().max()) > 0
    finally:
        destroy_parallel()


@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_te_gpt_finite_difference_kl_probe_predicts_the_actual_kl(fp8):
    """TE kernels have no forward-mode rules: ``kl.probe=auto`` takes the finite-difference probe
    for TE targets, and its prediction for the paper step (bf16, α chosen for a 1e-3 budget) agrees
    with the exact KL measured after applying that step, within 25% (the calibrated controller
    corrects what remains). With FP8 training GEMMs too: the probe's forwards run in bf16."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    from megatron_logra.kl.fd_probe import fd_step, predicted_kl_fd
    from megatron_logra.kl.probe import ProbeBatch, measure_kl, probe_method
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.train.step import Batch, forward_backward

    groups = initialize_parallel(ParallelConfig(), seed=1)
    try:
        cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256,
                          seq_length=64, params_dtype="bfloat16", transformer_impl="transformer_engine", fp8=fp8)
        model = build_gpt(cfg, groups, seed=3)
        opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=RANK, recipe="paper"),
                                                     native=NativeConfig(freeze=True)), groups)
        assert probe_method("auto", opt.sketches) == "finite_difference"
        gen = torch.Generator("cuda").manual_seed(0)
        tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=gen)
        pos = torch.arange(64, device="cuda")[None].expand(2, -1).contiguous()
        mask = torch.ones(2, 64, device="cuda")
        opt.zero_grad()
        r = forward_backward(model, [Batch(tokens, torch.roll(tokens, -1, 1), mask, pos)], groups)
        update = opt.prepare(num_tokens=r.num_tokens)
        probe = ProbeBatch(tokens, pos, mask)
        h = fd_step(0.0, 0.005, opt.relative_update_norm(update, 1.0), torch.bfloat16)
        pred, old_logits = predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=h)
        assert pred > 0
        alpha = (1e-3 / pred) ** 0.5
        opt.apply(update, alpha)
        actual = measure_kl(model, probe, old_logits, groups)
        assert abs(actual / (alpha * alpha * pred) - 1.0) <= 0.25, (actual, alpha * alpha * pred)
    finally:
        destroy_parallel()
