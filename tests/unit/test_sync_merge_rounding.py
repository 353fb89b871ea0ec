"""Stochastic rounding inside the sketch-delta merge (``sync.apply``): unbiased, reproducible, keyed by
canonical coordinates, and named in the delta's header.

A KL-controlled step is far below bf16's spacing; rounded to nearest it vanishes from a bf16 weight.
The reference is the exact fp64 change ``−U·A``: with stochastic rounding the realised change must
equal it on average (regression slope ≈ 1), to nearest it is lost (slope ≈ 0).
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sketch.random_projection import projection
from megatron_logra.sync.apply import StochasticRounding, low_rank_merge_, shard_rows
from megatron_logra.sync.codec import SketchDelta, TargetFactor, decode, encode, expected_layout
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import quantize_factor

N_OUT, N_IN, R = 96, 128, 16


def _step(update: int, scale: float, n_out: int = N_OUT, n_in: int = N_IN):
    gen = torch.Generator().manual_seed(update)
    A = projection(7, "model.layers.0.mlp.down_proj", update, R, n_in)
    U = quantize_factor(scale * torch.randn(n_out, R, generator=gen))
    return U, A, -(U.double() @ A.double())


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_a_step_far_below_bf16_spacing_survives_only_stochastic_rounding(rounding):
    n = 512  # 4 x 262144 entries: the slope's standard error is below 0.01
    W0 = torch.full((n, n), 1.0).to(torch.bfloat16)  # spacing 2**-7 above 1.0, 2**-8 below
    num, den = 0.0, 0.0
    for update in range(4):
        U, A, intended = _step(update, 2e-4, n, n)  # entries ~2e-4: a fortieth of bf16's spacing
        assert intended.abs().max() < 2.0**-8  # every entry would round back to 1.0 to nearest
        W = W0.clone()
        noise = StochasticRounding(7, "model.layers.0.mlp.down_proj", update) if rounding == "stochastic" else None
        low_rank_merge_(W, U, A, rounding=noise)
        realised = W.double() - W0.double()
        num += (realised * intended).sum().item()
        den += (intended * intended).sum().item()
    slope = num / den
    if rounding == "stochastic":
        assert slope == pytest.approx(1.0, abs=0.05)
    else:
        assert slope == 0.0


def test_the_noise_is_a_function_of_the_canonical_entry_only():
    """Same (seed, target, update, canonical row, column): the same bits, whichever rows a weight holds and
    in which order; another update index: other noise. fp32 and fp16 weights are never rounded stochastically."""
    U, A, _ = _step(3, 5e-3)
    full = torch.randn(N_OUT, N_IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    merged = full.clone()
    low_rank_merge_(merged, U, A, rounding=StochasticRounding(7, "t", 3))
    rows = torch.randperm(N_OUT, generator=torch.Generator().manual_seed(2))[:40]
    part = full[rows].clone()
    low_rank_merge_(part, U[rows], A, rounding=StochasticRounding(7, "t", 3, rows=rows))
    assert torch.equal(part, merged[rows])
    cols = slice(32, 96)  # a row-parallel shard: its columns of A, its first column
    shard = full[:, cols].clone()
    low_rank_merge_(shard, U, A[:, cols], rounding=StochasticRounding(7, "t", 3, col_start=32))
    assert torch.equal(shard, merged[:, cols])
    other = full.clone()
    low_rank_merge_(other, U, A, rounding=StochasticRounding(7, "t", 4))
    assert not torch.equal(other, merged)
    for dtype in (torch.float32, torch.float16):
        a, b = full.to(dtype), full.to(dtype)
        low_rank_merge_(a, U, A, rounding=StochasticRounding(7, "t", 3))
        low_rank_merge_(b, U, A)
        assert torch.equal(a, b)


def test_shard_rows_are_the_rows_megatron_gathers():
    """Column-parallel shards: ``linear_qkv`` (stride 1) holds a block; ``linear_fc1`` (stride 2) holds its
    ``[gate_k; up_k]`` of the canonical ``[gate; up]``."""
    assert shard_rows(4, 1, 3).tolist() == [4, 5, 6, 7]
    gate_up = torch.arange(24)  # canonical [gate (12); up (12)] at TP 3
    for k in range(3):
        local = torch.cat([gate_up[4 * k : 4 * k + 4], gate_up[12 + 4 * k : 12 + 4 * k + 4]])
        assert torch.equal(shard_rows(8, k, 3, stride=2), local)
    with pytest.raises(ValueError, match="cannot hold 2 row blocks"):
        shard_rows(7, 0, 2, stride=2)


def test_the_header_names_the_rounding_and_refuses_an_unknown_one():
    name = "model.layers.0.mlp.down_proj"
    U, _, _ = _step(0, 1e-3)
    delta = SketchDelta(0, 1, 7, 0, R, "rademacher", [TargetFactor(name, U, N_IN, expected_layout(name))],
                        rounding="stochastic")
    assert decode(encode(delta)).rounding == "stochastic"
    delta.rounding = "up"
    with pytest.raises(SyncError, match="unknown rounding 'up'") as exc:
        encode(delta)
    assert exc.value.kind == "keys"


class _RowOnlyNoise:
    """A deliberately broken noise (the row hash alone, the same for every column): what the second-moment
    check below must catch."""

    def __init__(self, rounding: StochasticRounding):
        self.rounding = rounding

    def parts(self, n_out, n_in, device):
        row_bits, col_bits = self.rounding.parts(n_out, n_in, device)
        return row_bits, torch.zeros_like(col_bits)


def _sum_variance_ratios(make_noise, steps: int = 48, n: int = 128) -> tuple[float, float]:
    """Observed mean square of the rounding error of row sums and of column sums of a stochastically rounded
    bf16 merge, over what independent per-entry noise gives (``Σ f(1−f)·spacing²``); the exact value each
    entry rounds is the fp32 merge of the same delta."""
    # one sign and one binade (spacing 2**-7): errors of entries that share noise are then positively correlated
    W0 = (1.25 + 0.5 * torch.rand(n, n, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    observed_rows = observed_cols = expected_rows = expected_cols = 0.0
    for step in range(steps):
        U, A, _ = _step(step, 2e-2, n, n)  # a few spacings
        exact = W0.float()
        low_rank_merge_(exact, U, A)  # fp32(W0) ⊖ P: what the bf16 merge rounds
        merged = W0.clone()
        low_rank_merge_(merged, U, A, rounding=make_noise(StochasticRounding(9, "t", step)))
        toward_zero = (exact.view(torch.int32) & -65536).view(torch.float32)  # the bf16 neighbour toward zero
        away = torch.nextafter(toward_zero.to(torch.bfloat16), torch.sign(exact).to(torch.bfloat16) * float("inf"))
        spacing = (away.double() - toward_zero.double()).abs()
        realised = merged.double()
        on_grid = realised == toward_zero.double()
        assert bool((on_grid | (realised == away.double()) | (spacing == 0)).all())  # one of the two neighbours
        frac = torch.where(spacing > 0, (exact.double() - toward_zero.double()).abs() / spacing, torch.zeros_like(spacing))
        var = frac * (1 - frac) * spacing**2
        err = realised - exact.double()
        observed_rows += (err.sum(1) ** 2).sum().item()
        observed_cols += (err.sum(0) ** 2).sum().item()
        expected_rows += var.sum().item()
        expected_cols += var.sum().item()
    return observed_rows / expected_rows, observed_cols / expected_cols


def test_rounding_errors_of_row_and_column_sums_have_the_variance_of_independent_noise():
    """The noise ``ρ_i XOR γ_j`` is pairwise independent: the error of a row's (or a column's) sum has the
    variance of independent per-entry rounding (SE of the ratio ~2% here), which a noise correlated along
    rows (the row hash alone) misses by an order of magnitude."""
    rows, cols = _sum_variance_ratios(lambda rounding: rounding)
    assert rows == pytest.approx(1.0, abs=0.12) and cols == pytest.approx(1.0, abs=0.12)
    broken_rows, _ = _sum_variance_ratios(_RowOnlyNoise, steps=8)
    assert broken_rows > 5.0


def test_bf16_merges_are_the_same_bits_for_any_chunking_and_thread_count():
    """The CPU chunk follows the thread count (``chunk_elems``): a trainer and an engine running different
    thread counts must still merge the same bits, to nearest and stochastically."""
    n_out, n_in = 300, 160
    U, A, _ = _step(5, 5e-3, n_out, n_in)
    W0 = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    for rounding in (None, StochasticRounding(7, "t", 5)):
        results = []
        try:
            for num_threads, chunk in ((1, None), (2, None), (1, 16 * n_in), (2, 7 * 16 * n_in), (1, 1 << 22)):
                torch.set_num_threads(num_threads)
                W = W0.clone()
                low_rank_merge_(W, U, A, rounding=rounding, max_chunk_elems=chunk)
                results.append(W)
        finally:
            torch.set_num_threads(threads)
        assert not torch.equal(results[0], W0)
        assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("layout,tp", [("hf", 1), ("sglang", 1), ("sglang", 2)])
def test_a_stochastic_apply_rounds_every_engine_weight_as_the_trainer_merges_its_canonical_rows(layout, tp):
    """``apply_delta_`` draws the noise of all its weights together; each engine weight (a piece of a fused or
    split target, a TP shard) must still get the bits of the one-target merge the trainer runs on it with the
    weight's canonical rows and first column."""
    from megatron_logra.sync.apply import apply_delta_
    from megatron_logra.sync.layout import plan_for
    from megatron_logra.sync.synthetic import DenseShape, random_delta

    shape = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40)
    delta = random_delta(shape, 8, seed=3, step=11, scale=2e-3, rounding="stochastic")
    gen = torch.Generator().manual_seed(0)
    for tp_rank in range(tp):
        plan = plan_for(delta, layout, tp, tp_rank)
        weights = {f.param: torch.randn(f.U_OR.shape[0], len(f.cols) if f.cols is not None else f.n_in,
                                        generator=gen).to(torch.bfloat16) for f in plan.factors}
        before = {k: v.clone() for k, v in weights.items()}
        apply_delta_(weights, delta, 0, layout=layout, tp_size=tp, tp_rank=tp_rank)
        for f in plan.factors:
            A = projection(delta.seed, f.target, delta.update_index, delta.rank, f.n_in)
            col_start = f.cols.start if f.cols is not None else 0
            if f.cols is not None:
                A = A[:, f.cols.start : f.cols.stop]
            expect = before[f.param].clone()
            low_rank_merge_(expect, f.U_OR, A, rounding=StochasticRounding(delta.seed, f.target, delta.step,
                                                                            f.rows, col_start))
            nearest = before[f.param].clone()
            low_rank_merge_(nearest, f.U_OR, A)
            assert torch.equal(weights[f.param], expect), f.param
            assert not torch.equal(expect, nearest), f.param  # the noise decided some entries
