"""The fused merge kernel and its check, the scaled factor ``V = grid(s·U)``, and the projection cache.

References: the scaled factor against a row-by-row float64 ``math.frexp`` reference
(``support.merge_reference``); the fused merge against the two-kernel one and against
``W − P`` in float64 (``P`` exact); the check against kernels written here that round twice the
ways real BLAS kernels do (accumulating into ``W``; adding each block of the inner dimension into
``W``), which it must refuse.
"""

from __future__ import annotations

import pytest
import torch

import megatron_logra.sync.projection_cache as projection_cache_mod
import megatron_logra.sync.fused as fused
from megatron_logra.sketch.random_projection import projection
from megatron_logra.sync.apply import ProjectionCache, StochasticRounding, apply_delta_, low_rank_merge_
from megatron_logra.sync.factors import quantize_factor, rademacher_scale, scaled_factor
from megatron_logra.sync.synthetic import DenseShape, random_delta
from support.merge_reference import rademacher_product_reference, scaled_factor_reference


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    monkeypatch.setattr(fused, "_verdicts", {})
    yield


def _accumulate_into_w(W, V, B):
    """A kernel that starts from W and adds one rank term at a time (rounds r times)."""
    for k in range(V.shape[1]):
        W.sub_(V[:, k : k + 1] * B[k : k + 1, :])


def _split_inner(block):
    def kernel(W, V, B):  # adds each block of the inner dimension's partial sum into W (exact partials)
        for a in range(0, V.shape[1], block):
            W.sub_(V[:, a : a + block] @ B[a : a + block])
    return kernel


def _subnormals_as_zero(W, V, B):
    """A kernel that rounds once but reads subnormal weights as zero (DAZ, as some GEMMs do)."""
    W.masked_fill_(W.abs() < torch.finfo(torch.float32).tiny, 0.0).sub_(V @ B)


@pytest.mark.parametrize("n_out,n_in,rank", [(16, 16, 2), (16, 16, 3), (64, 48, 8), (256, 1024, 32), (1000, 40, 5)])
def test_check_refuses_kernels_that_round_twice(n_out, n_in, rank):
    assert not fused.agrees(n_out, n_in, rank, kernel=_accumulate_into_w)
    assert not fused.agrees(n_out, n_in, rank, kernel=_split_inner(max(1, rank // 2)))
    assert not fused.agrees(n_out, n_in, rank, kernel=_subnormals_as_zero)
    assert fused.agrees(n_out, n_in, rank, kernel=lambda W, V, B: W.sub_(V @ B))  # one rounding: accepted


def test_check_answers_false_off_cpu_and_cuda_small_blocks_or_switched_off(monkeypatch):
    assert not fused.fused_merge_ok(torch.device("meta"), 1024, 1024, 32)
    if not torch.cuda.is_available():
        assert not fused.fused_merge_ok(torch.device("cuda"), 1024, 1024, 32)
    assert not fused.fused_merge_ok(torch.device("cpu"), fused.MIN_SIDE - 1, 1024, 32)
    assert not fused.fused_merge_ok(torch.device("cpu"), 1024, fused.MIN_SIDE - 1, 32)
    monkeypatch.setenv(fused.FUSED_ENV, "0")
    assert not fused.fused_merge_ok(torch.device("cpu"), 1024, 1024, 32)


def test_a_true_verdict_holds_on_random_factors_of_that_shape():
    """Where the check says yes, addmm_ equals W ⊖ P on data it never saw (float64 reference)."""
    gen = torch.Generator().manual_seed(0)
    for n_out, n_in, rank in [(64, 64, 4), (256, 512, 32), (512, 128, 64), (96, 1024, 128)]:
        if not fused.fused_merge_ok(torch.device("cpu"), n_out, n_in, rank):
            continue
        for _ in range(3):
            V = scaled_factor(quantize_factor(torch.randn(n_out, rank, generator=gen) * 1e-2), rademacher_scale(rank))
            B = torch.randint(0, 2, (rank, n_in), generator=gen).float() * 2 - 1
            W = torch.randn(n_out, n_in, generator=gen)
            expect = (W.double() - V.double() @ B.double()).float()
            W.addmm_(V, B, alpha=-1)
            assert torch.equal(W, expect), (n_out, n_in, rank)


@pytest.mark.parametrize("rank", [1, 2, 3, 8, 17, 32, 128])
def test_scaled_factor_equals_the_row_by_row_reference(rank):
    gen = torch.Generator().manual_seed(rank)
    X = torch.randn(40, rank, generator=gen) * torch.logspace(-20, 3, 40)[:, None]
    X[3] = 0.0
    X[5] = 1e-31  # s·U below 2^-100: a zero row
    X[7, 0] = 3e38 / 2**10  # large rows keep their grid
    U = quantize_factor(X)
    s = rademacher_scale(rank)
    V = scaled_factor(U, s)
    assert V.dtype == torch.float32 and torch.equal(V.double(), scaled_factor_reference(U, s))
    assert not bool(V[3].any()) and not bool(V[5].any())
    # on its grid: every product with signs is exact in fp32
    B = torch.randint(0, 2, (rank, 64), generator=gen).double() * 2 - 1
    exact = V.double() @ B
    assert torch.equal(exact.float().double(), exact)
    # and within half a grid step (<= 2^(L-24) of the row max) plus the fp32 product's rounding of s·U
    exact_sU = U.double() * s
    err = (V.double() - exact_sU).abs()
    L = max(0, (rank - 1).bit_length())
    assert bool((err <= 2.0 ** (L - 24) * exact_sU.abs().amax(1, keepdim=True) + 2.0**-24 * exact_sU.abs()).all())
    assert torch.equal(scaled_factor(U, None), U.float())


@pytest.mark.parametrize("rank", [1, 5, 32, 256])
def test_scaled_factor_at_the_tiny_row_boundary_and_extremes_and_its_non_finite_rows(rank):
    """Rows whose max straddles 2^-100 after scaling, huge rows, subnormal entries, fp32 input (the
    generic path) and non-finite rows (flagged by scaled_factor_rows, the finite rows still exact)."""
    from megatron_logra.sync.factors import scaled_factor_rows

    s = rademacher_scale(rank)
    gen = torch.Generator().manual_seed(rank)
    mags = [2.0**-100 / s * f for f in (0.999, 1.0, 1.001, 1.5)] + [2.0**-133, 1e-30, 1.0, 2.0**120, 3e38]
    X = torch.rand(len(mags), rank, generator=gen) * torch.tensor(mags)[:, None] * torch.where(
        torch.rand(len(mags), rank, generator=gen) < 0.5, -1.0, 1.0)
    X[:, 0] = torch.tensor(mags)  # the row max itself
    U = X.to(torch.bfloat16)
    V, bad = scaled_factor_rows(U, s)
    assert torch.equal(V.double(), scaled_factor_reference(U, s)) and not bool(bad.any())
    assert torch.equal(scaled_factor(U.float(), s), V)  # the fp32 input path gives the same bits
    U2 = U.clone()
    U2[2, rank - 1] = float("nan")
    U2[5, 0] = float("-inf")
    V2, bad2 = scaled_factor_rows(U2, s)
    assert bad2.tolist() == [i in (2, 5) for i in range(len(mags))]
    keep = ~bad2
    assert torch.equal(V2[keep], V[keep])


@pytest.mark.parametrize("dtype,stochastic,decay", [(torch.float32, False, 1.0), (torch.float32, False, 0.99),
                                                    (torch.bfloat16, False, 1.0), (torch.bfloat16, True, 0.995),
                                                    (torch.float16, False, 1.0)])
def test_fused_and_two_kernel_merges_give_the_same_bits(monkeypatch, dtype, stochastic, decay):
    gen = torch.Generator().manual_seed(1)
    n_out, n_in, rank = 300, 256, 32
    W0 = torch.randn(n_out, n_in, generator=gen).to(dtype)
    U = quantize_factor(torch.randn(n_out, rank, generator=gen) * 1e-2)
    A = projection(5, "model.layers.0.mlp.down_proj", 0, rank, n_in)
    rounding = StochasticRounding(5, "model.layers.0.mlp.down_proj", 3) if stochastic else None
    assert fused.fused_merge_ok(torch.device("cpu"), n_out, n_in, rank)  # this CPU's BLAS rounds once here
    calls = []
    real = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(fused.FUSED_ENV, mode)
        W = W0.clone()
        low_rank_merge_(W, U, A, decay=decay, rounding=rounding, max_chunk_elems=64 * n_in)
        out[mode] = W
    assert calls  # the fused kernel ran (mode 1) ...
    assert torch.equal(out["1"], out["0"])  # ... and gave the two-kernel bits
    P = rademacher_product_reference(U, A)
    if not stochastic:
        assert torch.equal(out["0"], (W0.float() * decay - P).to(dtype) if decay != 1.0 else (W0.float() - P).to(dtype))


SHAPE = DenseShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=50)


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=gen) for k, s in SHAPE.hf_shapes().items()}


def test_projection_cache_gives_the_uncached_bits_and_regenerates_only_on_a_new_projection(monkeypatch):
    made = []
    real = projection_cache_mod._signs
    monkeypatch.setattr(projection_cache_mod, "_signs", lambda *a: made.append(a[1:]) or real(*a))
    cache = ProjectionCache()
    cached, plain = _weights(), _weights()
    version = 0
    for step, update_index in enumerate([0, 0, 0, 1, 1]):
        delta = random_delta(SHAPE, 8, seed=9, update_index=update_index, base_version=version,
                             new_version=version + 1, generator_seed=step, scale=0.05)
        before = len(made)
        version = apply_delta_(cached, delta, version, cache=cache)
        regenerated = len(made) - before
        apply_delta_(plain, delta, version - 1)
        assert all(torch.equal(cached[k], plain[k]) for k in cached), step
        # a new projection (first sync, new update index) regenerates every group once; a repeat none
        assert (regenerated > 0) == (step in (0, 3)), (step, regenerated)
        assert regenerated in (0, len(cache))
    other = random_delta(SHAPE, 16, seed=9, base_version=version, new_version=version + 1, scale=0.05)  # another rank: replaced
    apply_delta_(cached, other, version, cache=cache)
    assert all(s.shape[1] == 16 for s in cache._signs.values())


def test_engines_keep_one_projection_cache(monkeypatch):
    from megatron_logra.sync.engine import ModuleEngine

    made = []
    real = projection_cache_mod._signs
    monkeypatch.setattr(projection_cache_mod, "_signs", lambda *a: made.append(1) or real(*a))

    engine = ModuleEngine(torch.nn.Module())
    weights = _weights()
    monkeypatch.setattr(engine, "weights", lambda: weights)
    for v in range(3):
        engine.apply_sketch_delta(random_delta(SHAPE, 8, seed=1, base_version=v, new_version=v + 1,
                                               generator_seed=v, scale=0.05))
    groups = len(engine._projections)
    assert groups > 0 and len(made) == groups  # regenerated on the first sync only
