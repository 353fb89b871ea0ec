"""The exact merge stays exact when the process allows reduced-precision fp32 matmuls.

``torch.set_float32_matmul_precision("medium")`` lets oneDNN compute fp32 matmuls in bf16 on a CPU
with AMX or AVX512-BF16 (``"high"``: TF32 on Ampere+ GPUs). The merge's ``V`` carries up to
``24 − log2 r`` significant bits, so a reduced-precision GEMM would change the bits of the product and
trainer and engine would drift apart. The reference is the float64 product (exact: ``V`` is on the
exact-sum grid) subtracted with one fp32 rounding.
"""

from __future__ import annotations

import contextlib

import pytest
from support import forked
import torch

from megatron_logra.sketch.random_projection import projection
from megatron_logra.sync.apply import apply_delta_, low_rank_merge_
from megatron_logra.sync.factors import quantize_factor, rademacher_scale, rademacher_signs, scaled_factor
from megatron_logra.sync.fused import _verdicts, fused_merge_ok
from megatron_logra.sync.precision import flushes_denormals, ieee_fp32
from megatron_logra.sync.synthetic import DenseShape, random_delta

N_OUT, N_IN, R = 256, 512, 32


@pytest.fixture
def reduced_precision():
    """``"medium"`` fp32 matmul precision for the test, the previous setting afterwards (the test
    skips where this CPU computes fp32 matmuls exactly anyway: there is nothing to guard against)."""
    before = (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        U = quantize_factor(1e-3 * torch.randn(N_OUT, R, generator=torch.Generator().manual_seed(0)))
        V = scaled_factor(U, rademacher_scale(R))
        B = rademacher_signs(projection(1, "t", 0, R, N_IN))[0]
        if torch.equal(V @ B, (V.double() @ B.double()).float()):
            pytest.skip("this CPU computes fp32 matmuls exactly even at bf16 precision")
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before


def _reference(W: torch.Tensor, U: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    V = scaled_factor(U, rademacher_scale(U.shape[1]))
    B = rademacher_signs(A)[0]
    return (W.double() - V.double() @ B.double()).float()  # the product is exact: one rounding


@pytest.mark.parametrize("fused_env", ["1", "0"])
def test_the_merge_is_exact_under_bf16_fp32_matmul_precision(reduced_precision, monkeypatch, fused_env):
    """Both kernels (the fused GEMM-and-subtract and the two-kernel form) give ``W ⊖ V·sign(A)``; the
    fused kernel's check, measured under the reduced precision, would have turned it off."""
    monkeypatch.setenv("MEGATRON_LOGRA_FUSED_MERGE", fused_env)
    _verdicts.clear()
    gen = torch.Generator().manual_seed(1)
    W = 0.02 * torch.randn(N_OUT, N_IN, generator=gen)
    U = quantize_factor(1e-3 * torch.randn(N_OUT, R, generator=gen))
    A = projection(3, "model.layers.0.mlp.down_proj", 0, R, N_IN)
    merged = W.clone()
    low_rank_merge_(merged, U, A)
    assert torch.equal(merged, _reference(W, U, A))
    assert fused_merge_ok(W.device, N_OUT, N_IN, R) == (fused_env == "1")
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # the process's choice is back


def test_an_engine_apply_is_bitwise_equal_to_the_ieee_apply_under_bf16_precision(reduced_precision):
    shape = DenseShape(hidden=256, layers=1, heads=4, kv_heads=2, ffn=512, vocab=96)
    gen = torch.Generator().manual_seed(2)
    weights = {k: 0.02 * torch.randn(*s, generator=gen) for k, s in shape.hf_shapes().items()}
    delta = random_delta(shape, R, scale=1e-3)
    reduced = {k: v.clone() for k, v in weights.items()}
    apply_delta_(reduced, delta, 0)
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    ieee = {k: v.clone() for k, v in weights.items()}
    apply_delta_(ieee, delta, 0)
    assert any(not torch.equal(ieee[k], weights[k]) for k in weights)
    for k in weights:
        assert torch.equal(reduced[k], ieee[k]), k


def test_the_settings_come_back_when_the_body_raises():
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with ieee_fp32():
                assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
                assert torch.backends.cuda.matmul.fp32_precision == "ieee"
                raise RuntimeError("inside")
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before


_LEGACY_USER = r"""
import sys, torch
from megatron_logra.sync.precision import flushes_denormals, ieee_fp32
how = sys.argv[1]
if how == "allow_tf32":
    torch.backends.cuda.matmul.allow_tf32 = True
elif how == "medium":
    torch.set_float32_matmul_precision("medium")
else:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
def read():
    if how == "new_api":
        return (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    return (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
before = read()
with ieee_fp32():
    pass
print(before == read(), before)
"""


@pytest.mark.parametrize("how", ["allow_tf32", "medium", "new_api"])
def test_a_process_reads_back_its_own_settings_with_its_own_api(how):
    """torch refuses to answer the legacy getters once the legacy and per-backend APIs were mixed; the
    switch must leave a process that used either API readable with it (a process of its own each, forked warm
    where it can be: the fork server imported torch and the libraries but set none of these settings)."""
    out = forked.python(["-c", _LEGACY_USER, how], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("True"), out.stdout


@contextlib.contextmanager
def flushed_denormals():
    """``torch.set_flush_denormal(True)`` for the body (the test skips where the CPU cannot flush). The inputs
    are made before: under flushing, building subnormal test weights would itself give zeros."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        yield
        assert flushes_denormals()  # the process's mode is back after the merge
    finally:
        torch.set_flush_denormal(False)


def _subnormal_case():
    gen = torch.Generator().manual_seed(4)
    W = torch.randint(-(1 << 20), 1 << 20, (N_OUT, N_IN), generator=gen).float() * 2.0**-149  # all subnormal
    U = quantize_factor(2.0**-90 * torch.randn(N_OUT, R, generator=gen))
    U[::2] = 0.0  # rows that leave their subnormal weights as they are (IEEE; flushing zeroes them)
    return W, U, projection(5, "model.layers.1.self_attn.o_proj", 0, R, N_IN)


def test_the_merge_of_subnormal_weights_is_ieee_with_denormals_flushed():
    W, U, A = _subnormal_case()
    assert bool((W != 0).all()) and not flushes_denormals()
    merged = W.clone()
    with flushed_denormals():
        low_rank_merge_(merged, U, A)
    assert torch.equal(merged, _reference(W, U, A))
    assert torch.equal(merged[0::2], W[0::2]) and not torch.equal(merged[1::2], W[1::2])


def test_an_engine_apply_of_subnormal_weights_is_ieee_with_denormals_flushed():
    shape = DenseShape(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=96)
    gen = torch.Generator().manual_seed(6)
    weights = {k: torch.randint(-(1 << 20), 1 << 20, s, generator=gen).float() * 2.0**-149
               for k, s in shape.hf_shapes().items()}
    delta = random_delta(shape, R, scale=2.0**-90)
    for t in delta.targets:
        t.U_OR[::2] = 0.0  # rows whose subnormal weights stay as they are
    ieee = {k: v.clone() for k, v in weights.items()}
    apply_delta_(ieee, delta, 0)
    flushed = {k: v.clone() for k, v in weights.items()}
    with flushed_denormals():
        apply_delta_(flushed, delta, 0)
    assert any(not torch.equal(ieee[k], weights[k]) for k in weights)
    assert all(bool((ieee[k] != 0).any()) for k in weights)
    for k in weights:
        assert torch.equal(flushed[k], ieee[k]), k
