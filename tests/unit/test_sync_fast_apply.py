"""The engine's apply path against a naive per-target reference, bitwise (DESIGN §1 "Sketch-delta policy sync").

The reference is written out here one engine parameter at a time, sharing no code with the
apply path: ``A`` is regenerated with the int64 hash ops (the CPU apply uses the int32 ones),
and the update is the documented formula in its plainest form,
``round_to_weight_dtype(decay·fp32(W) − grid(s·U)·sign(A))`` with the sum ``grid(s·U)·sign(A)``
taken in float64 (exact: the factors are on the exact-sum grid), i.e. ``W − U·A`` with the
one rounding the contract allows. The literal ``W − U.float() @ A.float()`` (which rounds every
product) is checked to agree within fp32 rounding. Shapes, ranks (powers of two and not),
weight dtypes, decay, chunk sizes and engine layouts (HF, SGLang at TP 1/2/4 with GQA) are
drawn at random from fixed seeds.
"""

from __future__ import annotations

import math

import pytest
import torch

import megatron_logra.sketch.random_projection as rp
import megatron_logra.sync.projection_cache as projection_cache_mod
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.factors import check_factor, check_factors, quantize_factor, rademacher_signs
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.synthetic import DenseShape, random_delta
from support.merge_reference import rademacher_product_reference


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _reference_projection(seed: int, name: str, update: int, rank: int, n_in: int) -> torch.Tensor:
    """The full ``A`` from the int64 hash ops (the non-CPU path), independent of the int32 one."""
    saved = rp._fast_path
    rp._fast_path = lambda device: False
    try:
        return rp.projection(seed, name, update, rank, n_in)
    finally:
        rp._fast_path = saved


def _naive_merge(W: torch.Tensor, U: torch.Tensor, A: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay·W − U·A`` for one weight: ``P = grid(s·U)·sign(A)`` summed in float64 (exact), then the
    contract's fp32 roundings."""
    P = rademacher_product_reference(U, A)
    Wf = W.float() if decay == 1.0 else W.float() * decay
    return (Wf - P).to(W.dtype)


def _random_shape(gen: torch.Generator) -> DenseShape:
    def pick(*xs):
        return xs[int(torch.randint(0, len(xs), (1,), generator=gen))]

    G = pick(1, 2, 4)
    H = G * pick(1, 2, 4)
    d = pick(4, 8)
    return DenseShape(hidden=H * d, layers=2, heads=H, kv_heads=G, ffn=pick(16, 24, 48), vocab=40)


def _weights_for(plan, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for f in plan.factors:
        cols = len(f.cols) if f.cols is not None else f.n_in
        out[f.param] = torch.randn(f.U_OR.shape[0], cols, generator=gen).to(dtype)
    return out


CASES = [  # (rank, weight dtype, decay, max_chunk_elems)
    (8, torch.float32, 1.0, None),
    (12, torch.float32, 0.99, 16 * 8),
    (32, torch.bfloat16, 1.0, None),
    (17, torch.bfloat16, 0.995, 16 * 16),
    (64, torch.float16, 1.0, 16 * 24),
    (3, torch.float16, 0.9, None),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("layout,tp", [("hf", 1), ("sglang", 1), ("sglang", 2), ("sglang", 4)])
def test_apply_equals_naive_reference_per_parameter_bitwise(case, layout, tp):
    rank, dtype, decay, chunk = CASES[case]
    gen = torch.Generator().manual_seed(100 * case + tp)
    shape = _random_shape(gen)
    if layout == "sglang" and (shape.heads % tp or shape.ffn % tp or (shape.kv_heads % tp and tp % shape.kv_heads)):
        shape = DenseShape(hidden=32, layers=2, heads=8, kv_heads=2, ffn=48, vocab=40)
    delta = random_delta(shape, rank, seed=case, update_index=7 * case, scale=0.05, generator_seed=case)
    delta.decay = decay
    A_full = {t.name: _reference_projection(delta.seed, t.name, delta.update_index, rank, t.n_in) for t in delta.targets}
    for tp_rank in range(tp):
        plan = plan_for(delta, layout, tp, tp_rank)
        weights = _weights_for(plan, dtype, gen)
        before = {k: v.clone() for k, v in weights.items()}
        assert apply_delta_(weights, delta, 0, layout=layout, tp_size=tp, tp_rank=tp_rank, max_chunk_elems=chunk) == 1
        for f in plan.factors:
            A = A_full[f.target] if f.cols is None else A_full[f.target][:, f.cols.start : f.cols.stop]
            expect = _naive_merge(before[f.param], f.U_OR, A, decay)
            got = weights[f.param]
            assert got.dtype == dtype and torch.equal(got, expect), f.param
            literal = before[f.param].double() * decay - f.U_OR.float() @ A.float()
            tol = 2.0 ** -20 * (1 + literal.abs().max()) if dtype == torch.float32 else 2.0 ** -7 * (1 + literal.abs().max())
            assert float((got.double() - literal).abs().max()) <= tol
            assert not torch.equal(got, before[f.param])


def test_column_shards_equal_slices_of_the_unsharded_apply():
    """Row-parallel weights (o_proj, down_proj): each TP rank's columns after its apply equal
    those columns of the TP-1 engine's weight after its apply."""
    shape = DenseShape(hidden=32, layers=1, heads=8, kv_heads=2, ffn=48, vocab=40)
    delta = random_delta(shape, 16, seed=3, update_index=2, scale=0.05)
    gen = torch.Generator().manual_seed(0)
    full = _weights_for(plan_for(delta, "sglang", 1, 0), torch.float32, gen)
    after = {k: v.clone() for k, v in full.items()}
    apply_delta_(after, delta, 0, layout="sglang")
    checked = 0
    for tp in (2, 4):
        for tp_rank in range(tp):
            plan = plan_for(delta, "sglang", tp, tp_rank)
            local = _weights_for(plan, torch.float32, gen)
            for f in plan.factors:
                if f.cols is not None:
                    local[f.param] = full[f.param][:, f.cols.start : f.cols.stop].clone()
            apply_delta_(local, delta, 0, layout="sglang", tp_size=tp, tp_rank=tp_rank)
            for f in plan.factors:
                if f.cols is not None:
                    assert torch.equal(local[f.param], after[f.param][:, f.cols.start : f.cols.stop]), (tp, f.param)
                    checked += 1
    assert checked == 2 * (2 + 4)


# --------------------------------------------------------------------------- pieces


def test_rademacher_signs_equal_torch_sign():
    for rank, n_in in [(1, 5), (8, 33), (32, 1024), (12, 7)]:
        A = rp.projection(4, "model.layers.0.mlp.down_proj", 1, rank, n_in)
        M, s = rademacher_signs(A)
        assert M.dtype == torch.float32 and torch.equal(M, torch.sign(A))
        assert s == float(torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32))


def _naive_check(U: torch.Tensor) -> tuple[bool, int]:
    """(finite, off-grid rows) written out from the definition, row by row in float64."""
    finite = bool(torch.isfinite(U.float()).all())
    if not finite:
        return False, 0
    L = max(0, math.ceil(math.log2(U.shape[1])))
    off = 0
    for row in U.double():
        m = float(row.abs().max())
        if m < 2.0**-100:
            off += int(bool(row.any()))
            continue
        e = math.frexp(m)[1]
        q = 2.0 ** max(e + L - 24, -149)
        off += int(any(float(v) / q != math.floor(float(v) / q) for v in row))
    return True, off


def test_check_factor_equals_the_definition():
    gen = torch.Generator().manual_seed(5)
    for r in (1, 2, 7, 8, 32, 100):
        X = torch.randn(40, r, generator=gen) * torch.logspace(-30, 30, 40)[:, None]
        U = quantize_factor(X)
        assert check_factor(U) == _naive_check(U) == (True, 0)
        raw = X.bfloat16()
        raw[3] = 0
        raw[4] = 1e-35  # a tiny row that is not zero
        raw[5, 0] = 2.0**-133  # bf16 subnormal
        assert check_factor(raw) == _naive_check(raw)
        assert check_factor(raw)[1] > (0 if r == 1 else 1)
        for bad in (float("nan"), float("inf"), -float("inf")):
            V = U.clone()
            V[7, r - 1] = bad
            assert check_factor(V) == (False, 0)
    # huge rows (q > 2^16): an entry at bf16's smallest subnormal would underflow U/q to zero in fp32
    big = quantize_factor(torch.randn(6, 8, generator=gen) * 2.0**60)
    assert check_factor(big) == _naive_check(big) == (True, 0)
    big[2, 5] = 2.0**-133
    assert check_factor(big) == _naive_check(big) == (True, 1)
    assert check_factor(torch.zeros(0, 4, dtype=torch.bfloat16)) == (True, 0)
    with pytest.raises(ValueError):
        check_factor(torch.zeros(3, 4))


def test_check_factors_batch_equals_each_factor_alone():
    gen = torch.Generator().manual_seed(9)
    r = 16
    factors = []
    for i in range(12):
        X = torch.randn(int(torch.randint(1, 50, (1,), generator=gen)), r, generator=gen) * 10.0 ** (i - 6)
        U = quantize_factor(X) if i % 3 else (X * torch.logspace(-9, 0, r)).bfloat16()  # raw bf16: off the grid
        if i == 4:
            U[0, 3] = float("nan")
        if i == 7:
            U[-1, 0] = float("inf")
        if i == 9:
            U[0] = 1e-35
        factors.append(U)
    factors.append(torch.zeros(0, r, dtype=torch.bfloat16))
    got = check_factors(factors)
    assert got == [_naive_check(U) for U in factors]
    assert got[4] == (False, 0) and got[7] == (False, 0) and got[9][1] >= 1 and got[3][1] > 0
    assert check_factors([]) == []
    with pytest.raises(ValueError):
        check_factors([factors[0], torch.zeros(2, r)])


def test_apply_computes_each_layers_projection_once_and_shares_nothing_after(monkeypatch):
    shape = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40)
    delta = random_delta(shape, 8)
    plan = plan_for(delta, "hf")
    weights = _weights_for(plan, torch.float32, torch.Generator().manual_seed(0))
    batches = []
    real = projection_cache_mod.rademacher_projections

    def counting(seed, names, *args, **kw):
        batches.append(list(names))
        return real(seed, names, *args, **kw)

    monkeypatch.setattr(projection_cache_mod, "rademacher_projections", counting)
    apply_delta_(weights, delta, 0)
    # one batch per input width (hidden: q/k/v/o/gate/up; ffn: down), each layer's A once: 8, not 14
    assert len(plan.factors) == 14 and len(batches) == 2
    assert sorted(n for b in batches for n in b) == sorted(t.name for t in delta.targets)
    with rp.shared_projections():
        a = rp.projection(1, "x", 0, 4, 9)
        assert rp.projection(1, "x", 0, 4, 9) is a
        assert rp.projection(1, "x", 0, 4, 9, cols=[0, 1]) is not rp.projection(1, "x", 0, 4, 9, cols=[0, 1])
    assert rp.projection(1, "x", 0, 4, 9) is not a and torch.equal(rp.projection(1, "x", 0, 4, 9), a)


def test_check_factors_batches_stay_bounded_and_agree_with_one_factor_at_a_time(monkeypatch):
    """Small factors are checked together, never more than the batch bound at once (the engine runs this on the
    host for every delta: a 27B delta's factors are ~1 GiB), and every factor's verdict is its own."""
    import megatron_logra.sync.factors as factors_mod

    gen = torch.Generator().manual_seed(3)
    fs = [quantize_factor(torch.randn(n, r, generator=gen) * 1e-3)
          for n, r in [(40, 8), (0, 8), (3, 8), (200, 8), (17, 4), (5, 8), (64, 8), (9, 8)]]
    fs[3][7, 2] = float("nan")
    fs[6][1, 1] = 2.0**-30 * (1 + 2.0**-7)  # exact in bf16, not a multiple of the row's grid (~2^-29)
    sizes = []
    real = factors_mod._check_factor

    def recording(U):
        sizes.append(U.numel())
        return real(U)

    monkeypatch.setattr(factors_mod, "_BATCH_ELEMS", 400)
    monkeypatch.setattr(factors_mod, "_check_factor", recording)
    got = check_factors(fs)
    assert got == [real(U) for U in fs]
    assert got[3][0] is False and got[6] == (True, 1)
    assert max(sizes) <= max(400, max(U.numel() for U in fs))
    assert len(sizes) < len(fs) + 4  # batched: far fewer checks than factors plus the per-factor reruns
