"""Tests of the counter-based projection ``A`` and of canonical layer names.

Statistical checks use bounds derived from the sample size (Hoeffding / DKW / CLT at a
very small false-alarm probability), so they fail only for a real defect, never by chance
(the inputs are fixed, so every test is deterministic anyway).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_logra.sketch.naming import canonical_name, strip_wrappers
from megatron_logra.sketch.random_projection import DISTRIBUTIONS, hash_u32, projection

DISTS = ("rademacher", "gaussian")
QKV = "model.layers.3.self_attn.qkv_proj"


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _hoeffding_mean_pm1(n: int, delta: float) -> float:
    """Deviation t with P(|mean of n iid ±1| >= t) <= delta (Hoeffding)."""
    return math.sqrt(2.0 * math.log(2.0 / delta) / n)


# --------------------------------------------------------------------------- hashing


def _lowbias32_ref(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers (the published reference)."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x


def test_hash_u32_matches_python_reference_without_int64_overflow():
    gen = torch.Generator().manual_seed(0)
    edge = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    rand = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64).tolist()
    values = edge + rand
    got = hash_u32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_lowbias32_ref(v) for v in values]
    assert all(0 <= g < 2**32 for g in got)


# --------------------------------------------------------------------------- slicing


@pytest.mark.parametrize("dist", DISTS)
def test_column_subsets_equal_full_matrix_columns_bitwise(dist):
    r, n_in = 16, 300
    full = projection(7, QKV, 2, r, n_in, distribution=dist)
    assert full.shape == (r, n_in) and full.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(n_in, generator=gen)[:57].tolist()  # unsorted, arbitrary
    cases = {
        "range": (range(40, 171), list(range(40, 171))),
        "tp-shard-last": (range(225, 300), list(range(225, 300))),
        "list-unsorted": (perm, perm),
        "list-duplicates": ([5, 5, 299, 0, 5, 17], [5, 5, 299, 0, 5, 17]),
        "tensor": (torch.tensor(perm[::-1]), perm[::-1]),
        "slice": (slice(3, 250, 7), list(range(3, 250, 7))),
        "slice-open": (slice(None, 11), list(range(0, 11))),
        "single": ([123], [123]),
    }
    for label, (cols, idx) in cases.items():
        part = projection(7, QKV, 2, r, n_in, distribution=dist, cols=cols)
        assert torch.equal(part, full[:, idx]), label
    empty = projection(7, QKV, 2, r, n_in, distribution=dist, cols=[])
    assert empty.shape == (r, 0)


@pytest.mark.parametrize("dist", DISTS)
def test_entries_do_not_depend_on_n_in(dist):
    # A[k, j] is a function of (seed, name, update, k, j): a wider layer extends A, it does not reshuffle it.
    a = projection(3, QKV, 0, 8, 64, distribution=dist)
    b = projection(3, QKV, 0, 8, 200, distribution=dist)
    assert torch.equal(a, b[:, :64])


def test_default_distribution_is_rademacher():
    assert set(DISTS) <= set(DISTRIBUTIONS)
    assert torch.equal(projection(1, QKV, 0, 8, 40), projection(1, QKV, 0, 8, 40, distribution="rademacher"))


# --------------------------------------------------------------------------- determinism
#
# One child process (torch imports cost seconds) serves two tests: it blocks megatron and
# transformers before importing the projection (engine-side import isolation), and it
# recomputes the determinism cases with another str-hash seed and thread count.

_DET_CASES = [
    [0, QKV, 0, 32, 1000, "rademacher", None],
    [0, QKV, 0, 32, 1000, "gaussian", None],
    [123456789, "decoder.layers.7.mlp.linear_fc2", 41, 16, 4096, "gaussian", [4095, 0, 17, 2048]],
    [2**40 + 3, "model.layers.0.self_attn.o_proj", 5, 8, 777, "rademacher", list(range(300, 500))],
]

_CHILD = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys
    BLOCKED = {"megatron", "transformers", "sglang", "transformer_engine", "apex"}

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, _Block())
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the import blocker does not work")

    import hashlib, torch
    torch.set_num_threads(1)
    naming = importlib.import_module("megatron_logra.sketch.naming")
    projection = importlib.import_module("megatron_logra.sketch.random_projection")
    from megatron_logra.sketch import canonical_name, projection as proj_fn

    a = projection.projection(0, "decoder.layers.1.mlp.linear_fc1", 0, 4, 16, distribution="gaussian", cols=[3, 1])
    b = proj_fn(0, "model.layers.1.mlp.up_proj", 0, 4, 16, distribution="gaussian")
    assert a.shape == (4, 2) and bool((a == b[:, [3, 1]]).all())
    assert naming.canonical_name("decoder.layers.1.mlp.linear_fc1") == canonical_name("model.layers.1.mlp.gate_proj")
    hashes = []
    for seed, name, update, rank, n_in, dist, cols in json.loads(sys.argv[1]):
        t = projection.projection(seed, name, update, rank, n_in, distribution=dist, cols=cols)
        hashes.append(hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print(json.dumps({
        "blocked_loaded": loaded,
        "capture_loaded": any(f"megatron_logra.sketch.{m}" in sys.modules
                              for m in ("capture", "sketch_set", "targets")),
        "hashes": hashes,
    }))
    """
)


@pytest.fixture(scope="module")
def child_report():
    env = dict(os.environ, PYTHONHASHSEED="98765")  # str hash() differs from this process
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(_DET_CASES)], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_deterministic_across_processes(child_report):
    here = [_sha(projection(s, n, u, r, i, distribution=d, cols=c)) for s, n, u, r, i, d, c in _DET_CASES]
    again = [_sha(projection(s, n, u, r, i, distribution=d, cols=c)) for s, n, u, r, i, d, c in _DET_CASES]
    assert here == again
    assert len(set(here)) == len(here)
    assert child_report["hashes"] == here


def test_projection_and_naming_import_without_megatron_or_transformers(child_report):
    assert child_report["blocked_loaded"] == []
    assert child_report["capture_loaded"] is False


# --------------------------------------------------------------------------- keys


def _agreement_bound(n: int) -> float:
    return _hoeffding_mean_pm1(n, 1e-9)


@pytest.mark.parametrize("dist", DISTS)
def test_different_seed_name_update_give_unrelated_matrices(dist):
    r, n_in = 16, 1024
    base = projection(5, QKV, 3, r, n_in, distribution=dist)
    others = {
        "seed": projection(6, QKV, 3, r, n_in, distribution=dist),
        "update": projection(5, QKV, 4, r, n_in, distribution=dist),
        "update0": projection(5, QKV, 0, r, n_in, distribution=dist),
        "layer": projection(5, "model.layers.4.self_attn.qkv_proj", 3, r, n_in, distribution=dist),
        "kind": projection(5, "model.layers.3.self_attn.o_proj", 3, r, n_in, distribution=dist),
        "mlp-in": projection(5, "model.layers.3.mlp.gate_up_proj", 3, r, n_in, distribution=dist),
        "mlp-out": projection(5, "model.layers.3.mlp.down_proj", 3, r, n_in, distribution=dist),
    }
    n = r * n_in
    # Independent matrices: the normalised inner product <A, B> / (|A||B|) is a mean of n
    # products with mean 0 and variance 1/n (for ±1 entries bounded by Hoeffding).
    bound = _agreement_bound(n) if dist == "rademacher" else 6.0 / math.sqrt(n)
    for label, other in others.items():
        assert not torch.equal(base, other), label
        corr = float((base.double() * other.double()).sum() / (base.double().norm() * other.double().norm()))
        assert abs(corr) < bound, (label, corr, bound)
    # the alternatives are also pairwise distinct
    hashes = {_sha(t) for t in others.values()} | {_sha(base)}
    assert len(hashes) == len(others) + 1


@pytest.mark.parametrize("dist", DISTS)
def test_canonical_equivalent_names_share_the_matrix(dist):
    names = [
        "module.decoder.layers.3.self_attention.linear_qkv",
        "decoder.layers.3.self_attention.linear_qkv.weight",
        "model.layers.3.self_attn.q_proj",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj",
        "_orig_mod.model.layers.3.self_attn.qkv_proj",
        "module._orig_mod.decoder.layers.3._checkpoint_wrapped_module.self_attention.linear_qkv.weight",
        QKV,
    ]
    ref = projection(11, QKV, 2, 8, 96, distribution=dist)
    for name in names:
        assert torch.equal(projection(11, name, 2, 8, 96, distribution=dist), ref), name
    fc1 = ["decoder.layers.1.mlp.linear_fc1", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
           "model.layers.1.mlp.gate_up_proj.weight"]
    ref1 = projection(11, fc1[0], 0, 8, 96, distribution=dist)
    assert not torch.equal(ref1, ref)
    for name in fc1:
        assert torch.equal(projection(11, name, 0, 8, 96, distribution=dist), ref1), name


# --------------------------------------------------------------------------- moments

R_STAT, N_STAT = 64, 8192


def test_rademacher_entries_signs_and_balance():
    for r in (R_STAT, 48):  # 48: 1/sqrt(r) not a power of two
        a = projection(2, QKV, 0, r, N_STAT)
        mag = torch.tensor(1.0 / math.sqrt(r), dtype=torch.float32)
        assert bool(((a == mag) | (a == -mag)).all())
    a = projection(2, QKV, 0, R_STAT, N_STAT)
    signs = torch.sign(a).double()
    n = signs.numel()
    assert abs(float(signs.mean())) < _hoeffding_mean_pm1(n, 1e-9)
    # sign balance of every row: per-row mean of n_in ±1, union bound over the rows
    row_bound = _hoeffding_mean_pm1(N_STAT, 1e-9 / R_STAT)
    assert float(signs.mean(dim=1).abs().max()) < row_bound
    # and of every column (mean of r signs): union bound over columns
    col_bound = _hoeffding_mean_pm1(R_STAT, 1e-9 / N_STAT)
    assert col_bound < 1.0  # non-vacuous: a constant column would fail
    assert float(signs.mean(dim=0).abs().max()) < col_bound


def test_rademacher_gram_is_identity_in_expectation():
    r, n_in = R_STAT, 512
    a = projection(4, QKV, 1, r, n_in).double()
    gram = a.T @ a  # [n_in, n_in]
    # the diagonal is sum_k A_kj^2 = r * (1/r): exactly 1
    assert torch.allclose(torch.diagonal(gram), torch.ones(n_in, dtype=torch.float64), rtol=0, atol=1e-12)
    off = gram[~torch.eye(n_in, dtype=torch.bool)]
    # each off-diagonal entry is a mean of r independent ±1: Hoeffding with a union bound over pairs
    pairs = n_in * (n_in - 1) // 2
    max_bound = _hoeffding_mean_pm1(r, 1e-6 / pairs)  # ~ 7.3 / sqrt(r)
    assert float(off.abs().max()) < max_bound
    # mean of the off-diagonal entries: std 1/sqrt(r * pairs) (distinct pairs are uncorrelated)
    assert abs(float(off.mean())) < 6.0 / math.sqrt(r * pairs)
    # ||AᵀA - I||_F^2 has mean n(n-1)/r and std ~ 2 sqrt(n(n-1))/r (0.4 % here): check within 5 %
    frob2 = float((off**2).sum())
    expected = n_in * (n_in - 1) / r
    assert abs(frob2 / expected - 1.0) < 0.05, frob2 / expected
    # averaged over independent draws (updates), E[AᵀA] -> I
    draws, n_small = 64, 32
    acc = torch.zeros(n_small, n_small, dtype=torch.float64)
    for u in range(draws):
        b = projection(4, QKV, u, 16, n_small).double()
        acc += b.T @ b
    acc /= draws
    mean_off = acc[~torch.eye(n_small, dtype=torch.bool)]
    # each entry: mean of draws*16 ±1 products; union bound over the pairs
    assert float(mean_off.abs().max()) < _hoeffding_mean_pm1(draws * 16, 1e-9 / (n_small**2))
    assert torch.allclose(torch.diagonal(acc), torch.ones(n_small, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dist", DISTS)
def test_rows_are_not_duplicated_or_correlated(dist):
    a = projection(9, "model.layers.0.mlp.down_proj", 0, R_STAT, N_STAT, distribution=dist).double()
    a = a / a.norm(dim=1, keepdim=True)
    corr = a @ a.T
    off = corr[~torch.eye(R_STAT, dtype=torch.bool)]
    pairs = R_STAT * (R_STAT - 1) // 2
    if dist == "rademacher":
        bound = _hoeffding_mean_pm1(N_STAT, 1e-6 / pairs)  # ~0.073
    else:
        # sample correlation of independent Gaussian rows ~ N(0, 1/n); 6 sigma with a union over
        # 2016 pairs has false-alarm probability < 1e-5
        bound = 6.0 / math.sqrt(N_STAT)
    assert float(off.abs().max()) < bound


def test_gaussian_moments_and_shape():
    r = R_STAT
    a = projection(13, QKV, 0, r, N_STAT, distribution="gaussian")
    assert a.dtype == torch.float32 and bool(torch.isfinite(a).all())
    z = a.double() * math.sqrt(r)  # should be N(0, 1)
    n = z.numel()
    mean = float(z.mean())
    var = float(z.var())
    m4 = float(((z - mean) ** 4).mean())
    # CLT: std(mean) = 1/sqrt(n); std(sample var) = sqrt(2/n); std(mean of z^4) = sqrt(96/n)
    assert abs(mean) < 6.0 / math.sqrt(n)
    assert abs(var - 1.0) < 6.0 * math.sqrt(2.0 / n)
    assert abs(m4 / var**2 - 3.0) < 6.0 * math.sqrt(96.0 / n) + 12.0 * math.sqrt(2.0 / n)
    # variance of the stored entries is 1/r
    assert abs(float(a.double().var()) * r - 1.0) < 6.0 * math.sqrt(2.0 / n)
    # Kolmogorov-Smirnov against N(0,1); DKW: P(D > eps) <= 2 exp(-2 n eps^2)
    zs, _ = torch.sort(z.flatten())
    cdf = torch.special.ndtr(zs)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max(float((i / n - cdf).max()), float((cdf - (i - 1) / n).max()))
    assert d < math.sqrt(math.log(2.0 / 1e-6) / (2.0 * n))
    # per-row means are also centred (no row offset); union over rows
    row_mean = z.mean(dim=1)
    assert float(row_mean.abs().max()) < 6.0 / math.sqrt(N_STAT)
    # gram diagonal: chi^2_r / r averaged over columns -> 1
    diag = (a.double() ** 2).sum(dim=0)
    assert abs(float(diag.mean()) - 1.0) < 6.0 * math.sqrt(2.0 / (r * N_STAT))


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rank=0),
        dict(rank=-3),
        dict(n_in=0),
        dict(n_in=-1),
        dict(distribution="uniform"),
        dict(distribution="Rademacher"),
        dict(cols=[0, 16]),
        dict(cols=[-1]),
        dict(cols=range(10, 17)),
        dict(cols=torch.tensor([3, 100])),
        dict(update=-1),
    ],
)
def test_bad_input_raises_value_error(kwargs):
    args = dict(seed=0, name=QKV, update=0, rank=4, n_in=16)
    args.update(kwargs)
    extra = {k: args.pop(k) for k in ("distribution", "cols") if k in args}
    with pytest.raises(ValueError):
        projection(args["seed"], args["name"], args["update"], args["rank"], args["n_in"], **extra)


# --------------------------------------------------------------------------- canonical names

_MAPPING = [
    # megatron
    ("decoder.layers.0.self_attention.linear_qkv", "model.layers.0.self_attn.qkv_proj"),
    ("decoder.layers.12.self_attention.linear_qkv.weight", "model.layers.12.self_attn.qkv_proj"),
    ("decoder.layers.3.self_attention.linear_proj", "model.layers.3.self_attn.o_proj"),
    ("decoder.layers.3.self_attention.linear_proj.weight", "model.layers.3.self_attn.o_proj"),
    ("decoder.layers.5.mlp.linear_fc1", "model.layers.5.mlp.gate_up_proj"),
    ("decoder.layers.5.mlp.linear_fc1.weight", "model.layers.5.mlp.gate_up_proj"),
    ("decoder.layers.5.mlp.linear_fc2", "model.layers.5.mlp.down_proj"),
    ("decoder.layers.5.mlp.linear_fc2.weight", "model.layers.5.mlp.down_proj"),
    # wrapped megatron
    ("module.decoder.layers.3.self_attention.linear_qkv", "model.layers.3.self_attn.qkv_proj"),
    ("_orig_mod.decoder.layers.3.self_attention.linear_proj.weight", "model.layers.3.self_attn.o_proj"),
    ("module.module.decoder.layers.2.mlp.linear_fc1.weight", "model.layers.2.mlp.gate_up_proj"),
    ("decoder.layers.2._checkpoint_wrapped_module.mlp.linear_fc2", "model.layers.2.mlp.down_proj"),
    ("module._orig_mod.decoder.layers.9._checkpoint_wrapped_module.self_attention.linear_qkv.weight",
     "model.layers.9.self_attn.qkv_proj"),
    # HF
    ("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.qkv_proj"),
    ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.qkv_proj"),
    ("model.layers.3.self_attn.v_proj", "model.layers.3.self_attn.qkv_proj"),
    ("model.layers.3.self_attn.o_proj.weight", "model.layers.3.self_attn.o_proj"),
    ("model.layers.4.mlp.gate_proj", "model.layers.4.mlp.gate_up_proj"),
    ("model.layers.4.mlp.up_proj.weight", "model.layers.4.mlp.gate_up_proj"),
    ("model.layers.4.mlp.down_proj", "model.layers.4.mlp.down_proj"),
    ("_orig_mod.model.layers.4.mlp.down_proj.weight", "model.layers.4.mlp.down_proj"),
    # SGLang (fused)
    ("model.layers.6.self_attn.qkv_proj", "model.layers.6.self_attn.qkv_proj"),
    ("model.layers.6.self_attn.qkv_proj.weight", "model.layers.6.self_attn.qkv_proj"),
    ("model.layers.6.mlp.gate_up_proj", "model.layers.6.mlp.gate_up_proj"),
    ("_orig_mod.model.layers.6.self_attn.qkv_proj", "model.layers.6.self_attn.qkv_proj"),
]

_PASS_THROUGH = [
    ("embedding.word_embeddings.weight", "embedding.word_embeddings"),
    ("module.embedding.word_embeddings.weight", "embedding.word_embeddings"),
    ("_orig_mod.output_layer.weight", "output_layer"),
    ("module.decoder.final_layernorm.weight", "decoder.final_layernorm"),
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("model.norm.weight", "model.norm"),
    ("lm_head.weight", "lm_head"),
    ("lm_head", "lm_head"),
    ("_checkpoint_wrapped_module.lm_head.weight", "lm_head"),
    ("module._checkpoint_wrapped_module.output_layer.weight", "output_layer"),
    ("_orig_mod.module.model.embed_tokens", "model.embed_tokens"),
]


@pytest.mark.parametrize("name,expected", _MAPPING)
def test_canonical_name_mapping(name, expected):
    assert canonical_name(name) == expected
    assert canonical_name(expected) == expected


@pytest.mark.parametrize("name,expected", _PASS_THROUGH)
def test_canonical_name_non_layer_names_pass_through_unwrapped(name, expected):
    assert canonical_name(name) == expected
    assert strip_wrappers(name) == expected


def test_canonical_name_layer_index_override():
    assert canonical_name("decoder.layers.0.mlp.linear_fc1", layer_index=5) == "model.layers.5.mlp.gate_up_proj"
    assert canonical_name("module.decoder.layers.1.self_attention.linear_qkv.weight", layer_index=17) == (
        "model.layers.17.self_attn.qkv_proj"
    )
    assert canonical_name("model.layers.2.self_attn.o_proj", layer_index=0) == "model.layers.0.self_attn.o_proj"
    # an explicit index equal to the local one changes nothing; layer_index=0 is not "unset"
    assert canonical_name("decoder.layers.3.mlp.linear_fc2", layer_index=3) == canonical_name(
        "decoder.layers.3.mlp.linear_fc2"
    )
    assert canonical_name("decoder.layers.3.mlp.linear_fc2", layer_index=0) != canonical_name(
        "decoder.layers.3.mlp.linear_fc2"
    )


def test_canonical_name_is_idempotent():
    names = [n for n, _ in _MAPPING] + [n for n, _ in _PASS_THROUGH] + [
        "decoder.layers.4.input_layernorm.weight",
        "model.layers.4.post_attention_layernorm.weight",
        "decoder.layers.1.self_attention.core_attention",
    ]
    for name in names:
        once = canonical_name(name)
        assert canonical_name(once) == once, name
        with_index = canonical_name(name, layer_index=8)
        assert canonical_name(with_index) == with_index, name


def test_distinct_layers_and_kinds_stay_distinct():
    names = {
        canonical_name(f"decoder.layers.{i}.{k}")
        for i in range(3)
        for k in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    }
    assert len(names) == 12


# --------------------------------------------------------------------------- CPU int32 path
#
# On the CPU ``projection`` evaluates the per-entry hash on int32 bit patterns (wrapping
# arithmetic); elsewhere it keeps the int64 ops. Both must give the same bits, and both must
# equal the hash chain written out in plain Python integers.


def _int64_path(*args, **kwargs):
    """``projection`` with the int64 ops forced (the path non-CPU devices take)."""
    import megatron_logra.sketch.random_projection as rp

    saved = rp._fast_path
    rp._fast_path = lambda device: False
    try:
        return rp.projection(*args, **kwargs)
    finally:
        rp._fast_path = saved


def _entry_ref(key, k: int, j: int, lane: int) -> int:
    """``_entry_hash`` of one entry in plain Python integers."""
    m, golden = 0xFFFFFFFF, 0x9E3779B9
    k0, k1, k2, k3 = key
    salt = (lane * golden) & m
    row_h = _lowbias32_ref(_lowbias32_ref((k ^ k0) & m) ^ k1 ^ salt)
    col_h = _lowbias32_ref(_lowbias32_ref((j ^ k2) & m) ^ k3)
    mixed = _lowbias32_ref(((row_h + col_h * golden) & m) ^ salt)
    return _lowbias32_ref(mixed ^ row_h)


def test_int32_hash_matches_python_reference_on_edge_values():
    from megatron_logra.sketch.random_projection import _hash_i32_

    gen = torch.Generator().manual_seed(3)
    edge = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFE, 0xFFFFFFFF]
    values = edge + torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64).tolist()
    x = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    got = (_hash_i32_(x, torch.empty_like(x)).to(torch.int64) & 0xFFFFFFFF).tolist()
    assert got == [_lowbias32_ref(v) for v in values]


@pytest.mark.parametrize("dist", DISTS)
def test_cpu_int32_path_equals_int64_path_bitwise(dist):
    gen = torch.Generator().manual_seed(11)
    cases = [
        (0, QKV, 0, 32, 1024, None),
        (2**40 + 3, "model.layers.0.self_attn.o_proj", 5, 8, 777, range(300, 500)),
        (123456789, "decoder.layers.7.mlp.linear_fc2", 41, 17, 4096, [4095, 0, 17, 2048, 17]),
        (7, "model.layers.1.mlp.gate_up_proj", 2**31 + 5, 1, 3, slice(1, None)),
        (1, "lm_head", 0, 256, 129, torch.tensor([128, 0])),
        (5, QKV, 9, 12, 300, range(0)),
    ]
    for _ in range(6):
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        rank = int(torch.randint(1, 70, (1,), generator=gen))
        n_in = int(torch.randint(1, 3000, (1,), generator=gen))
        cases.append((seed, f"model.layers.{seed % 40}.mlp.down_proj", seed % 1000, rank, n_in, None))
    for seed, name, update, rank, n_in, cols in cases:
        fast = projection(seed, name, update, rank, n_in, distribution=dist, cols=cols)
        ref = _int64_path(seed, name, update, rank, n_in, distribution=dist, cols=cols)
        assert fast.dtype == ref.dtype == torch.float32 and fast.shape == ref.shape
        assert torch.equal(fast.view(torch.int32), ref.view(torch.int32)), (seed, name, rank, n_in, cols)


def test_rademacher_entries_equal_the_plain_python_hash_chain():
    from megatron_logra.sketch.random_projection import projection_key

    seed, update, rank, n_in = 99, 3, 12, 5000
    A = projection(seed, QKV, update, rank, n_in)
    key = projection_key(seed, QKV, update)
    s = float(torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32))
    for k, j in [(0, 0), (0, 4999), (11, 0), (11, 4999), (5, 2**12 + 1), (7, 1234)]:
        want = s if _entry_ref(key, k, j, 0) >> 31 == 0 else -s
        assert float(A[k, j]) == want


def test_cpu_path_bad_columns_still_raise():
    with pytest.raises(ValueError, match="cols must lie"):
        projection(0, QKV, 0, 4, 10, cols=range(5, 11))
    with pytest.raises(ValueError, match="cols must lie"):
        projection(0, QKV, 0, 4, 10, cols=range(-1, 3))
    assert projection(0, QKV, 0, 4, 10, cols=range(3, 3)).shape == (4, 0)


@pytest.mark.parametrize("cols", [None, range(100, 300), range(0, 1), range(999, 1000)])
@pytest.mark.parametrize("rank", [1, 3, 32])
def test_batched_rademacher_projections_equal_one_call_per_layer(cols, rank):
    from megatron_logra.sketch.random_projection import rademacher_projections

    names = [f"model.layers.{i}.mlp.down_proj" for i in range(4)] + ["decoder.layers.2.self_attention.linear_qkv"]
    batch = rademacher_projections(11, names, 4, rank, 1000, cols=cols)
    for name, got in zip(names, batch):
        assert torch.equal(got, projection(11, name, 4, rank, 1000, cols=cols))


def test_batched_rademacher_projections_fall_back_off_the_fast_path(monkeypatch):
    import megatron_logra.sketch.random_projection as rp

    monkeypatch.setattr(rp, "_fast_path", lambda device: False)
    batch = rp.rademacher_projections(3, ["a", "b"], 0, 8, 64, cols=range(8, 40))
    assert torch.equal(batch[1], rp.projection(3, "b", 0, 8, 64, cols=range(8, 40)))


def test_batched_entry_pre_hashes_equal_the_int64_reference_per_key():
    """``entry_hash_parts_many`` (the rounding noise of many weights at once) gives, for every key, the
    pre-hashes whose combination is the int64 reference hash of every entry (``_entry_hash``, the
    non-CPU path), empty row or column sets included; mismatched inputs are refused."""
    from megatron_logra.sketch.random_projection import (
        _entry_hash, entry_hash_block_, entry_hash_parts_many, projection_key)

    keys = [projection_key(s, f"model.layers.{s}.mlp.down_proj", 3) for s in range(4)]
    rows = [torch.arange(5, 40), torch.tensor([7, 3, 1000, 2]), torch.arange(0), torch.arange(9)]
    cols = [torch.arange(20, 52), torch.arange(3), torch.arange(6), torch.arange(0)]
    lane = 3
    row_h, col_g = entry_hash_parts_many(keys, rows, cols, lane)
    lane_salt = (lane * 0x9E3779B9) & 0xFFFFFFFF
    for k, r, c, rh, cg in zip(keys, rows, cols, row_h, col_g):
        assert rh.shape == r.shape and cg.shape == c.shape
        out = torch.empty(len(r), len(c), dtype=torch.int32)
        entry_hash_block_(out, rh, cg, lane_salt, torch.empty_like(out))
        assert torch.equal(out.long() & 0xFFFFFFFF, _entry_hash(k, r.long(), c.long(), lane))
    low_r, low_c = entry_hash_parts_many(keys, rows, cols, lane, low_bits=16)
    assert all(torch.equal(a, b & 0xFFFF) for a, b in zip(low_r + low_c, row_h + col_g))
    with pytest.raises(ValueError, match="as many keys"):
        entry_hash_parts_many(keys, rows[:3], cols, lane)
