"""The merge arithmetic and the all-or-nothing apply of a sketch delta (DESIGN §1 "Sketch-delta policy sync").

References are computed here: ``W − U·A`` in float64 (naive), and the documented fp32 formula
written out with one plain ``torch.mm`` per weight (for the bitwise checks). ``A`` comes from
``projection`` (an input of the method, keyed by canonical name). Rejection tests compare
every weight bitwise to a copy taken before the attempt.
"""

from __future__ import annotations

import pytest
import torch

import megatron_logra.sync.apply as apply_mod
import megatron_logra.sync.projection_cache as projection_cache_mod
from megatron_logra.sketch.random_projection import projection
from megatron_logra.sync.apply import (
    apply_delta_,
    low_rank_merge_,
    merge_row_chunks,
    off_grid_rows,
    quantize_factor,
    rademacher_scale,
    validate,
)
from megatron_logra.sync.codec import decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.synthetic import DenseShape, random_delta
from support.merge_reference import rademacher_product_reference
from support.sglang_stand_ins import SGLangQwen2


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


SHAPE = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40)
RANK = 8


def _hf_weights(dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=gen).to(dtype) for k, s in SHAPE.hf_shapes().items()}


def _snapshot(weights):
    return {k: v.clone() for k, v in weights.items()}


def _same(a, b) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("n_out,n_in", [(5, 7), (16, 33), (200, 64), (1000, 40)])
def test_merge_row_chunks_cover_rows_with_at_least_16_each(n_out, n_in):
    chunks = merge_row_chunks(n_out, n_in, max_chunk_elems=64 * 17)
    rows = [r for a, b in chunks for r in range(a, b)]
    assert rows == list(range(n_out))
    assert all(b - a >= min(16, n_out) for a, b in chunks)


def _rademacher_product(U, A):
    """The documented product for a Rademacher A: grid(s·U)·sign(A), exact (float64 reference)."""
    assert torch.equal(A.abs(), torch.full_like(A, rademacher_scale(A.shape[0])))
    return rademacher_product_reference(U, A)


def test_quantize_factor_keeps_large_entries_and_puts_rows_on_the_exact_grid():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(64, 32, generator=gen) * torch.logspace(-12, 2, 64)[:, None]
    X[5, 3] = 1e-9 * X[5].abs().max()  # a tiny entry far below its row max
    X[7] = 1e-35  # a row below 2^-100
    U = quantize_factor(X)
    assert U.dtype == torch.bfloat16 and off_grid_rows(U) == 0
    bf = X.bfloat16().float()
    rowmax = bf.abs().amax(1, keepdim=True)
    big = bf.abs() >= rowmax / 128
    big[7] = False  # the tiny row is zeroed as a whole
    assert torch.equal(U.float()[big], bf[big])  # within 2^7 of the row max: the bf16 value itself
    err = (U.float() - bf).abs()
    keep = torch.ones(64, dtype=torch.bool)
    keep[7] = False
    assert bool((err[keep] <= rowmax[keep] * 2.0**-19).all())  # r=32: grid 2^(e+5-24), rowmax >= 2^(e-1)
    assert float(U.float()[5, 3]) == 0.0 and not bool(U.float()[7].any())
    assert off_grid_rows(X.bfloat16()) > 0  # raw bf16 rows spanning 1e-9 are off the grid


def test_rademacher_product_is_the_same_bits_for_any_split():
    gen = torch.Generator().manual_seed(1)
    U = quantize_factor(torch.randn(40, 8, generator=gen))
    A = projection(0, "model.layers.0.self_attn.o_proj", 0, 8, 32)
    full = torch.zeros(40, 32)
    low_rank_merge_(full, U, A)
    for rows in (slice(0, 1), slice(3, 5), slice(0, 40, 3)):
        for cols in (range(0, 8), range(8, 16), range(30, 32), range(32)):
            W = torch.zeros(len(range(40)[rows]), len(cols))
            low_rank_merge_(W, U[rows], A[:, cols.start : cols.stop])
            assert torch.equal(W, full[rows][:, cols.start : cols.stop])
    assert torch.equal(full, -_rademacher_product(U, A))


def test_fp32_merge_matches_naive_float64_and_the_documented_formula_bitwise():
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(96, 40, generator=gen)
    U = quantize_factor(torch.randn(96, RANK, generator=gen) * 0.1)
    A = projection(3, "model.layers.0.mlp.down_proj", 2, RANK, 40)
    naive = W.double() - U.double() @ A.double()
    expect = W - _rademacher_product(U, A)
    for chunk in (1 << 22, 16 * 40):  # one chunk / six chunks of 16 rows
        out = W.clone()
        low_rank_merge_(out, U, A, max_chunk_elems=chunk)
        assert torch.equal(out, expect)
        torch.testing.assert_close(out.double(), naive, rtol=0, atol=1e-5)
    assert (expect - W).abs().max() > 1e-2  # the update is far above the tolerance


def test_gaussian_merge_is_a_plain_fp32_gemm():
    gen = torch.Generator().manual_seed(4)
    W = torch.randn(48, 24, generator=gen)
    U = quantize_factor(torch.randn(48, RANK, generator=gen))
    A = projection(0, "z", 0, RANK, 24, distribution="gaussian")
    out = W.clone()
    low_rank_merge_(out, U, A, distribution="gaussian")
    assert torch.equal(out, W - torch.mm(U.float(), A))
    torch.testing.assert_close(out.double(), W.double() - U.double() @ A.double(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not a Rademacher projection"):
        low_rank_merge_(W.clone(), U, A, distribution="rademacher")


def test_fp32_merge_with_decay():
    gen = torch.Generator().manual_seed(2)
    W = torch.randn(32, 24, generator=gen)
    U = quantize_factor(torch.randn(32, RANK, generator=gen))
    A = projection(0, "x", 0, RANK, 24)
    out = W.clone()
    low_rank_merge_(out, U, A, decay=0.99)
    assert torch.equal(out, W * 0.99 - _rademacher_product(U, A))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_merge_rounds_the_fp32_result_to_nearest(dtype):
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(64, 48, generator=gen).to(dtype)
    U = quantize_factor(torch.randn(64, RANK, generator=gen) * 0.05)
    A = projection(0, "y", 1, RANK, 48)
    out = W.clone()
    low_rank_merge_(out, U, A, decay=0.999, max_chunk_elems=16 * 48)
    assert torch.equal(out, (W.float() * 0.999 - _rademacher_product(U, A)).to(dtype))
    assert not torch.equal(out, W)


def test_merge_rejects_shapes_that_do_not_chain():
    with pytest.raises(ValueError, match="do not chain"):
        low_rank_merge_(torch.zeros(4, 5), torch.zeros(4, 2), torch.zeros(2, 6))


# --------------------------------------------------------------------------- apply


def _naive_hf(weights0, delta, name, proj_name, rows_U):
    """W0 − U_rows·A for one HF projection, float64."""
    t = next(t for t in delta.targets if t.name == name)
    A = projection(delta.seed, name, delta.update_index, delta.rank, t.n_in, distribution=delta.distribution)
    return weights0[proj_name].double() - rows_U.double() @ A.double()


def test_apply_to_hf_weights_equals_naive_per_projection_and_copies_dense():
    weights = _hf_weights()
    before = _snapshot(weights)
    new_norm = torch.randn(32)
    delta = random_delta(SHAPE, RANK, seed=5, update_index=4, dense={"model.norm.weight": new_norm}, scale=0.05)
    assert apply_delta_(weights, delta, 0) == 1
    H, G, d = 4, 2, 8
    for i in range(SHAPE.layers):
        p = f"model.layers.{i}."
        U = {t.name: t.U_OR for t in delta.targets}
        qkv = U[p + "self_attn.qkv_proj"]
        # Megatron rows per group g: [q heads of g; k_g; v_g], each head d rows (independent loop)
        q_rows, k_rows, v_rows = [], [], []
        for g in range(G):
            base = g * (H // G + 2) * d
            for j in range(H // G):
                q_rows += list(range(base + j * d, base + (j + 1) * d))
            k_rows += list(range(base + (H // G) * d, base + (H // G + 1) * d))
            v_rows += list(range(base + (H // G + 1) * d, base + (H // G + 2) * d))
        gu = U[p + "mlp.gate_up_proj"]
        cases = {
            "self_attn.q_proj": ("self_attn.qkv_proj", qkv[q_rows]),
            "self_attn.k_proj": ("self_attn.qkv_proj", qkv[k_rows]),
            "self_attn.v_proj": ("self_attn.qkv_proj", qkv[v_rows]),
            "self_attn.o_proj": ("self_attn.o_proj", U[p + "self_attn.o_proj"]),
            "mlp.gate_proj": ("mlp.gate_up_proj", gu[:48]),
            "mlp.up_proj": ("mlp.gate_up_proj", gu[48:]),
            "mlp.down_proj": ("mlp.down_proj", U[p + "mlp.down_proj"]),
        }
        for proj, (target, rows_U) in cases.items():
            name = p + proj + ".weight"
            expect = _naive_hf(before, delta, p + target, name, rows_U)
            torch.testing.assert_close(weights[name].double(), expect, rtol=0, atol=1e-5)
            assert (weights[name] - before[name]).abs().max() > 1e-2
    assert torch.equal(weights["model.norm.weight"], new_norm)
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(weights[k], before[k])


def _rejected(weights, delta, version, kind, match):
    before = _snapshot(weights)
    with pytest.raises(SyncError, match=match) as exc:
        apply_delta_(weights, delta, version)
    assert exc.value.kind == kind
    assert _same(weights, before), "a rejected delta modified the weights"


def test_version_replay_gap_and_divergence_are_rejected_without_changes():
    weights = _hf_weights()
    first = random_delta(SHAPE, RANK, base_version=0, new_version=1)
    version = apply_delta_(weights, first, 0)
    _rejected(weights, first, version, "replay", "already applied")
    _rejected(weights, random_delta(SHAPE, RANK, base_version=2, new_version=3), version, "gap", "skips versions")
    _rejected(weights, random_delta(SHAPE, RANK, base_version=0, new_version=5), version, "version", "base 0 != engine version 1")


def test_nonfinite_values_are_rejected_without_changes():
    weights = _hf_weights()
    delta = random_delta(SHAPE, RANK, dense={"model.norm.weight": torch.ones(32)})
    delta.targets[-1].U_OR[3, 1] = float("nan")  # the last target: a partial apply would show everywhere else
    _rejected(weights, delta, 0, "nonfinite", "U of model.layers.1.mlp.down_proj has non-finite")
    delta = random_delta(SHAPE, RANK, dense={"model.norm.weight": torch.full((32,), float("inf"))})
    _rejected(weights, delta, 0, "nonfinite", "dense model.norm.weight")


def test_unknown_names_and_wrong_shapes_are_rejected_without_changes():
    weights = _hf_weights()
    deeper = DenseShape(hidden=32, layers=3, heads=4, kv_heads=2, ffn=48, vocab=40)
    _rejected(weights, random_delta(deeper, RANK), 0, "name", "model.layers.2.")
    _rejected(weights, random_delta(SHAPE, RANK, dense={"model.extra.weight": torch.ones(2)}), 0, "name", "model.extra.weight")
    wider = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=40)
    _rejected(weights, random_delta(wider, RANK), 0, "shape", r"gate_proj.weight: engine weight \(48, 32\), delta implies \(64, 32\)")
    _rejected(weights, random_delta(SHAPE, RANK, dense={"model.norm.weight": torch.ones(31)}), 0, "shape", "dense model.norm.weight")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"].double()
    _rejected(weights, random_delta(SHAPE, RANK), 0, "dtype", "torch.float64")


def test_factors_off_the_exact_grid_merge_exactly_and_as_the_trainer_merges_them():
    """The engine rounds ``V = grid(s·U)`` itself, so a factor off ``quantize_factor``'s grid is no
    hazard: it merges to the reference bits, the same as the trainer's merge of that factor."""
    weights = _hf_weights()
    delta = random_delta(SHAPE, RANK)
    t = delta.targets[2]
    t.U_OR[0, 0] = 1e-20  # a tiny entry quantize_factor would have rounded away
    assert off_grid_rows(t.U_OR) == 1
    before = _snapshot(weights)
    assert apply_delta_(weights, delta, 0) == 1
    A = projection(delta.seed, t.name, delta.update_index, RANK, t.n_in)
    trainer = torch.cat([before["model.layers.0.mlp.gate_proj.weight"], before["model.layers.0.mlp.up_proj.weight"]])
    low_rank_merge_(trainer, t.U_OR, A)
    engine = torch.cat([weights["model.layers.0.mlp.gate_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(engine, trainer)
    P = rademacher_product_reference(t.U_OR, A)
    assert torch.equal(trainer, torch.cat([before["model.layers.0.mlp.gate_proj.weight"],
                                           before["model.layers.0.mlp.up_proj.weight"]]) - P)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_failure_while_preparing_leaves_weights_untouched(monkeypatch, distribution):
    weights = _hf_weights()
    calls = {"n": 0}
    name = "rademacher_projections" if distribution == "rademacher" else "projection"
    real = getattr(projection_cache_mod, name)
    fail_at = 2 if distribution == "rademacher" else 9  # the second width's batch / the ninth layer's A

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("simulated out of memory")
        return real(*args, **kw)

    monkeypatch.setattr(projection_cache_mod, name, flaky)
    _rejected(weights, random_delta(SHAPE, RANK, distribution=distribution), 0, "apply", "failed before any write")
    assert calls["n"] == fail_at


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scalar_dense_parameter_is_applied_whole_and_bitwise(dtype):
    """A 0-d trained parameter (e.g. a logit scale) travels dense and is copied whole, after the merges."""
    weights = _hf_weights(dtype)
    weights["logit_scale"] = torch.tensor(1.0, dtype=dtype)
    reference = _snapshot(weights)
    delta = random_delta(SHAPE, RANK, scale=0.05, dense={"logit_scale": torch.tensor(2.5),
                                                         "model.norm.weight": torch.randn(32)})
    assert apply_delta_(weights, decode(encode(delta)), 0) == 1
    without = random_delta(SHAPE, RANK, scale=0.05, dense={"model.norm.weight": delta.dense["model.norm.weight"]})
    apply_delta_(reference, without, 0)
    reference["logit_scale"] = torch.tensor(2.5, dtype=dtype)
    assert _same(weights, reference)


@pytest.mark.parametrize("engine,sent", [(torch.tensor(0.5), torch.tensor(1.0)), (torch.tensor(0.5), torch.ones(40, 32)),
                                         (torch.ones(20), torch.ones(40, 32))])
def test_dense_the_commit_cannot_copy_is_rejected_before_any_write(engine, sent):
    """A vocab-parallel dense entry is copied as a row block: without matching rows there is nothing the commit
    could copy, so validation rejects it (a SyncError, never an IndexError) before the factors are merged."""
    weights = {n: p.detach().clone() for n, p in SGLangQwen2(_hf_weights(), tp=2, rank=1).named_parameters()}
    weights["model.embed_tokens.weight"] = engine.clone()
    before = _snapshot(weights)
    delta = random_delta(SHAPE, RANK, dense={"model.embed_tokens.weight": sent})
    with pytest.raises(SyncError, match="dense model.embed_tokens.weight") as exc:
        apply_delta_(weights, delta, 0, layout="sglang", tp_size=2, tp_rank=1)
    assert exc.value.kind == "shape"
    assert _same(weights, before), "a rejected delta modified the weights"


_L0 = "model.layers.0."


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dense", [
    {_L0 + "self_attn.q_proj.weight": torch.zeros(32, 32), _L0 + "self_attn.k_proj.weight": torch.zeros(16, 8),
     _L0 + "self_attn.v_proj.weight": torch.zeros(16, 8)},  # q/k/v of different widths
    {_L0 + "self_attn.q_proj.bias": torch.zeros(32, 1), _L0 + "self_attn.k_proj.bias": torch.zeros(16),
     _L0 + "self_attn.v_proj.bias": torch.zeros(16)},  # a 2-D bias among 1-D ones
    {_L0 + "self_attn.q_proj.bias": torch.zeros(()), _L0 + "self_attn.k_proj.bias": torch.zeros(()),
     _L0 + "self_attn.v_proj.bias": torch.zeros(())},  # 0-d parts
    {_L0 + "mlp.gate_proj.bias": torch.zeros(()), _L0 + "mlp.up_proj.bias": torch.zeros(())},  # 0-d gate/up
], ids=["qkv-widths", "qkv-bias-rank", "qkv-0d", "gate-up-0d"])
def test_dense_parts_the_sglang_layout_cannot_fuse_are_a_sync_error_before_any_write(dense, tp):
    """Dense q/k/v (gate/up) are stacked along their rows into qkv_proj (gate_up_proj); parts that do not stack
    are rejected as SyncError("shape") by validate and apply_delta_ alike, and nothing is written."""
    weights = {n: p.detach().clone() for n, p in SGLangQwen2(_hf_weights(), tp=tp, rank=tp - 1).named_parameters()}
    before = _snapshot(weights)
    delta = decode(encode(random_delta(SHAPE, RANK, dense=dense)))  # a well-formed message: only the layout objects
    with pytest.raises(SyncError) as exc:
        validate(delta, weights, 0, layout="sglang", tp_size=tp, tp_rank=tp - 1)
    assert exc.value.kind == "shape"
    with pytest.raises(SyncError) as exc:
        apply_delta_(weights, delta, 0, layout="sglang", tp_size=tp, tp_rank=tp - 1)
    assert exc.value.kind == "shape"
    assert _same(weights, before), "a rejected delta modified the weights"


def test_an_exception_while_mapping_the_layout_is_a_sync_error(monkeypatch):
    """validate promises SyncError for every rejection: an exception out of the layout mapping is one (layout)."""
    def broken(*args, **kwargs):
        raise IndexError("index 7 is out of bounds")
    monkeypatch.setattr(apply_mod, "plan_for", broken)
    weights = _hf_weights()
    with pytest.raises(SyncError, match="out of bounds") as exc:
        validate(random_delta(SHAPE, RANK), weights, 0)
    assert exc.value.kind == "layout"


def test_validate_touches_nothing_and_returns_the_plan():
    weights = _hf_weights(torch.bfloat16)
    before = _snapshot(weights)
    plan = validate(random_delta(SHAPE, RANK), weights, 0)
    assert len(plan.factors) == SHAPE.layers * 7
    assert _same(weights, before)


def test_bf16_weights_apply_equals_the_documented_rounding():
    weights = _hf_weights(torch.bfloat16)
    before = _snapshot(weights)
    delta = random_delta(SHAPE, RANK, scale=0.05)
    delta.decay = 0.99
    apply_delta_(weights, delta, 0)
    t = next(t for t in delta.targets if t.name == "model.layers.1.self_attn.o_proj")
    A = projection(delta.seed, t.name, 0, RANK, t.n_in)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(weights[name], (before[name].float() * 0.99 - _rademacher_product(t.U_OR, A)).bfloat16())
