"""Property-based tests of the layout maps: Megatron <-> Hugging Face <-> SGLang fused, on random tiny configs.

Configs: ``G`` query groups (1-4), ``H = G·(1..4)`` heads, head dim 1-4, hidden 1-8, ffn a
multiple of the engine TP size, which is drawn from the sizes SGLang accepts for them
(``H % T == 0`` and ``T | G`` or ``G | T``: kv heads are replicated when ``T > G``).

The references are written out here index by index: Megatron's per-group QKV interleave
``[q heads of g; k_g; v_g]``, ``[gate; up]``, SGLang's local ``[q heads of rank; kv heads of
rank; (v)]`` and ``[gate block; up block]``, row-parallel column blocks. Properties:

* Megatron -> HF -> Megatron is the identity (sync row maps, ``models.hf`` full-state maps and
  the checkpoint converter's ``build_full``/``split_to_hf``/``build_shard`` all agree);
* SGLang's fused ``qkv_proj``/``gate_up_proj`` (factors and biases) are the HF tensors
  concatenated, rank by rank, and the ranks' shards reassemble the full HF tensors
  (``engine_pieces`` of a model per rank), replicated kv heads equal;
* applying a delta commutes with the maps: Megatron-layout merge then map to HF equals the
  HF-layout apply equals every SGLang rank's apply (bit for bit with Rademacher projections),
  and all are within rounding of the float64 ``decay·W − U·A``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from megatron_logra.convert.combine import build_full, build_shard, split_to_hf
from megatron_logra.convert.tensor_plan import hf_expected_shapes, megatron_plan, place_shard, shard
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import (
    fuse_qkv,
    hf_shapes,
    hf_to_megatron,
    megatron_param_to_hf,
    megatron_shapes,
    megatron_to_hf,
    split_qkv,
)
from megatron_logra.sketch.random_projection import DISTRIBUTIONS, projection
from megatron_logra.sync.apply import apply_delta_, low_rank_merge_
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import quantize_factor
from megatron_logra.sync.layout import (
    megatron_rows_from_hf,
    plan_for,
    qkv_rows_hf,
    sglang_gate_up_rows,
    sglang_qkv_rows,
)
from megatron_logra.sync.sglang_weights import engine_pieces


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


_FAST = dict(deadline=None, derandomize=True, database=None)


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Tiny:
    """A tiny attention + MLP shape and an engine TP size SGLang accepts for it."""

    heads: int
    groups: int
    d: int
    hidden: int
    ffn: int
    tp: int
    layer: int

    @property
    def dims(self) -> AttentionDims:
        return AttentionDims(self.heads, self.groups, self.d)

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.d


def engine_tp_fits(heads: int, groups: int, tp: int) -> bool:
    """SGLang's QKVParallelLinear: heads split evenly; kv heads split evenly or replicated."""
    return heads % tp == 0 and (groups % tp == 0 if groups >= tp else tp % groups == 0)


@st.composite
def tiny_configs(draw: st.DrawFn) -> Tiny:
    groups = draw(st.integers(1, 4))
    heads = groups * draw(st.integers(1, 4))
    tp = draw(st.sampled_from([t for t in range(1, 9) if engine_tp_fits(heads, groups, t)]))
    return Tiny(heads, groups, draw(st.integers(1, 4)), draw(st.integers(1, 8)), tp * draw(st.integers(1, 4)), tp,
                draw(st.integers(0, 3)))


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# --------------------------------------------------------------------------- references written out by hand


def hand_qkv_rows(c: Tiny) -> list[int]:
    """Megatron rows of HF ``cat([q; k; v])``: group g's slots are ``[q heads of g; k_g; v_g]``."""
    per = c.heads // c.groups
    slot = lambda g, s: [(g * (per + 2) + s) * c.d + t for t in range(c.d)]  # noqa: E731
    q = [r for h in range(c.heads) for r in slot(h // per, h % per)]
    k = [r for g in range(c.groups) for r in slot(g, per)]
    v = [r for g in range(c.groups) for r in slot(g, per + 1)]
    return q + k + v


def kv_heads_of(c: Tiny, rank: int) -> list[int]:
    if c.groups >= c.tp:
        n = c.groups // c.tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (c.tp // c.groups)]


def hand_sglang_qkv_rows(c: Tiny, rank: int) -> list[int]:
    """Rows of HF ``cat([q; k; v])`` in rank ``rank``'s fused ``qkv_proj``: its q heads, then its kv heads."""
    hq = c.heads // c.tp
    heads = lambda hs, off: [off + h * c.d + t for h in hs for t in range(c.d)]  # noqa: E731
    kv = kv_heads_of(c, rank)
    q_size, kv_size = c.heads * c.d, c.groups * c.d
    return heads(range(rank * hq, (rank + 1) * hq), 0) + heads(kv, q_size) + heads(kv, q_size + kv_size)


def hand_gate_up_rows(c: Tiny, rank: int) -> list[int]:
    f = c.ffn // c.tp
    return list(range(rank * f, (rank + 1) * f)) + list(range(c.ffn + rank * f, c.ffn + (rank + 1) * f))


def hf_to_sglang_rank(hf: dict[str, torch.Tensor], c: Tiny, rank: int) -> dict[str, torch.Tensor]:
    """SGLang parameters of TP rank ``rank`` from HF tensors of one layer (weights and biases)."""
    p = f"model.layers.{c.layer}."
    out: dict[str, torch.Tensor] = {}
    qkv_rows = hand_sglang_qkv_rows(c, rank)
    gate_up_rows = hand_gate_up_rows(c, rank)
    for leaf in ("weight", "bias"):
        if p + f"self_attn.q_proj.{leaf}" in hf:
            fused = torch.cat([hf[p + f"self_attn.{x}_proj.{leaf}"] for x in "qkv"])
            out[p + f"self_attn.qkv_proj.{leaf}"] = fused[qkv_rows].clone()
        if p + f"mlp.gate_proj.{leaf}" in hf:
            fused = torch.cat([hf[p + f"mlp.gate_proj.{leaf}"], hf[p + f"mlp.up_proj.{leaf}"]])
            out[p + f"mlp.gate_up_proj.{leaf}"] = fused[gate_up_rows].clone()
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        w = hf[p + name]
        n = w.shape[1] // c.tp
        out[p + name] = w[:, rank * n : (rank + 1) * n].clone()
    for name, w in hf.items():
        if name.endswith("layernorm.weight"):
            out[name] = w.clone()
    return out


def _mcfg(c: Tiny, **kw) -> ModelConfig:
    return ModelConfig(num_layers=c.layer + 1, hidden_size=c.hidden, num_attention_heads=c.heads,
                       num_query_groups=c.groups, kv_channels=c.d, ffn_hidden_size=c.ffn, **kw)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what


def _within(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor) -> bool:
    """``|a − b| <= bound`` elementwise, in float64."""
    return a.shape == b.shape and bool(((a.double() - b.double()).abs() <= bound).all())


# --------------------------------------------------------------------------- Megatron <-> HF


@settings(max_examples=200, **_FAST)
@given(c=tiny_configs(), seed=st.integers(0, 2**31))
def test_megatron_hf_megatron_rows_are_the_identity(c: Tiny, seed: int) -> None:
    """The sync row maps are the hand-written interleave, a permutation whose inverse is
    ``megatron_rows_from_hf``, and agree with ``models.hf`` (``split_qkv``/``fuse_qkv``,
    ``megatron_param_to_hf``) on weights and biases; ``[gate; up]`` splits in halves."""
    rows = qkv_rows_hf(c.dims)
    perm = torch.cat([rows["q"], rows["k"], rows["v"]])
    assert perm.tolist() == hand_qkv_rows(c)
    inv = megatron_rows_from_hf(c.dims)
    ident = torch.arange(c.qkv_rows)
    assert torch.equal(perm[inv], ident) and torch.equal(inv[perm], ident)

    gen = torch.Generator().manual_seed(seed)
    cfg = _mcfg(c)
    pre = f"decoder.layers.{c.layer}."
    for leaf, shape in (("weight", (c.qkv_rows, c.hidden)), ("bias", (c.qkv_rows,))):
        W = _randn(*shape, gen=gen)
        parts = megatron_param_to_hf(pre + f"self_attention.linear_qkv.{leaf}", W, c.dims)
        assert [n for n, _ in parts] == [f"model.layers.{c.layer}.self_attn.{x}_proj.{leaf}" for x in "qkv"]
        q, k, v = (t for _, t in parts)
        for mine, theirs in zip((q, k, v), split_qkv(W, cfg)):
            assert_bitwise(mine, theirs)
        assert_bitwise(torch.cat([q, k, v])[inv], W)
        assert_bitwise(fuse_qkv(q, k, v, cfg), W)
    W = _randn(2 * c.ffn, c.hidden, gen=gen)
    (gate_name, gate), (up_name, up) = megatron_param_to_hf(pre + "mlp.linear_fc1.weight", W, None)
    assert (gate_name, up_name) == tuple(f"model.layers.{c.layer}.mlp.{x}_proj.weight" for x in ("gate", "up"))
    assert_bitwise(torch.cat([gate, up]), W)


_VARIANTS = [dict(), dict(add_qkv_bias=True), dict(add_bias_linear=True), dict(qk_layernorm=True),
             dict(untie_embeddings_and_output_weights=False)]


@settings(max_examples=60, **_FAST)
@given(c=tiny_configs(), variant=st.sampled_from(_VARIANTS), vocab=st.integers(1, 20), multiple=st.integers(1, 4),
       seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_full_state_megatron_hf_megatron_is_the_identity(c: Tiny, variant: dict, vocab: int, multiple: int,
                                                         seed: int, dtype: torch.dtype) -> None:
    """``hf_to_megatron(megatron_to_hf(state)) == state`` bit for bit for every layout variant
    (biases, q/k norms, tied head), and the HF side has exactly ``hf_shapes``."""
    cfg = _mcfg(c, vocab_size=vocab, make_vocab_size_divisible_by=multiple, **variant)
    gen = torch.Generator().manual_seed(seed)
    state = {k: _randn(*s, gen=gen, dtype=dtype) for k, s in megatron_shapes(cfg).items()}
    hf = megatron_to_hf(state, cfg)
    assert {k: tuple(v.shape) for k, v in hf.items()} == hf_shapes(cfg)
    back = hf_to_megatron(hf, cfg)
    assert set(back) == set(state)
    for k in state:
        assert_bitwise(back[k], state[k], k)


@settings(max_examples=80, **_FAST)
@given(c=tiny_configs(), variant=st.sampled_from(_VARIANTS), vocab=st.integers(1, 20), seed=st.integers(0, 2**31),
       trainer_tp=st.sampled_from([1, 2, 4]))
def test_checkpoint_converter_round_trips_and_shards(c: Tiny, variant: dict, vocab: int, seed: int,
                                                     trainer_tp: int) -> None:
    """The converter's ``build_full`` makes from HF tensors what ``hf_to_megatron`` makes (padded
    vocabulary rows zero), ``split_to_hf`` gives the HF tensors back, and at a trainer TP that fits,
    each rank's ``build_shard`` is ``shard(build_full)`` and ``place_shard`` of all ranks rebuilds it."""
    cfg = _mcfg(c, vocab_size=vocab, make_vocab_size_divisible_by=2, **variant)
    tp = trainer_tp if c.heads % trainer_tp == 0 and c.groups % trainer_tp == 0 and c.ffn % trainer_tp == 0 else 1
    gen = torch.Generator().manual_seed(seed)
    hf = {k: _randn(*s, gen=gen) for k, s in hf_expected_shapes(cfg).items()}

    def read(name: str, rows: Optional[tuple[int, int]] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = hf[name] if rows is None else hf[name][rows[0] : rows[1]]
        return t.clone() if out is None else out.copy_(t.reshape(out.shape))

    padded_hf = dict(hf)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in hf:
            pad = torch.zeros(cfg.padded_vocab_size(tp) - vocab, c.hidden)
            padded_hf[name] = torch.cat([hf[name], pad])
    expected = hf_to_megatron(padded_hf, cfg, tp=tp)
    for entry in megatron_plan(cfg, tp=tp, pp=1):
        full = build_full(entry, read, cfg, torch.float32)
        assert_bitwise(full, expected[entry.name], entry.name)
        for name, part in split_to_hf(entry, full, cfg):
            assert_bitwise(part.contiguous(), hf[name], name)
        rebuilt = torch.full_like(full, float("nan"))
        for rank in range(tp):
            piece = build_shard(entry, read, cfg, torch.float32, rank, tp, lambda n: hf[n].shape[0])
            assert_bitwise(piece, shard(full, entry.partition, rank, tp).contiguous(), f"{entry.name} rank {rank}")
            place_shard(rebuilt, piece, entry.partition, rank, tp)
        assert_bitwise(rebuilt, full, entry.name)


# --------------------------------------------------------------------------- HF <-> SGLang fused


def layer_delta(c: Tiny, rank: int, seed: int, *, distribution: str = "rademacher", decay: float = 1.0,
                biases: bool = True) -> SketchDelta:
    """A delta for the four targets of layer ``c.layer`` (grid factors) with q/k/v and gate/up biases dense."""
    gen = torch.Generator().manual_seed(seed)
    p = f"model.layers.{c.layer}."
    shapes = [("self_attn.qkv_proj", c.qkv_rows, c.hidden, "qkv_interleaved"),
              ("self_attn.o_proj", c.hidden, c.heads * c.d, "row_parallel"),
              ("mlp.gate_up_proj", 2 * c.ffn, c.hidden, "gate_up"),
              ("mlp.down_proj", c.hidden, c.ffn, "row_parallel")]
    targets = [TargetFactor(p + n, quantize_factor(torch.randn(o, rank, generator=gen) * 0.05), i, lay)
               for n, o, i, lay in shapes]
    dense: dict[str, torch.Tensor] = {}
    if biases:
        for x, n in (("q", c.heads), ("k", c.groups), ("v", c.groups)):
            dense[p + f"self_attn.{x}_proj.bias"] = _randn(n * c.d, gen=gen)
        dense[p + "mlp.gate_proj.bias"] = _randn(c.ffn, gen=gen)
        dense[p + "mlp.up_proj.bias"] = _randn(c.ffn, gen=gen)
        dense[p + "input_layernorm.weight"] = _randn(c.hidden, gen=gen)
    return SketchDelta(base_version=0, new_version=1, seed=seed, update_index=seed % 7, rank=rank,
                       distribution=distribution, targets=targets, dense=dense, decay=decay, attention=c.dims)


@settings(max_examples=200, **_FAST)
@given(c=tiny_configs(), rank=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_sglang_fused_factors_are_hf_concatenated_rank_by_rank(c: Tiny, rank: int, seed: int) -> None:
    """Per engine rank, SGLang's ``qkv_proj``/``gate_up_proj`` factor rows and fused biases are the
    HF q/k/v (gate/up) ones concatenated by hand for that rank; row-parallel targets keep all of U and
    take the rank's column block; at TP 1 the fused tensors are plain concatenations; the ranks'
    q/gate/up blocks concatenate to the full HF tensors and their kv heads cover every head, a
    replicated kv head equal on every rank that holds it."""
    event(f"engine TP {c.tp}" + (" (kv heads replicated)" if c.tp > c.groups else ""))
    delta = layer_delta(c, rank, seed)
    p = f"model.layers.{c.layer}."
    hf_plan = plan_for(delta, "hf")
    hf = {f.param: f.U_OR for f in hf_plan.factors} | {e.param: e.tensor for e in hf_plan.dense}
    meg_U = {t.name: t.U_OR for t in delta.targets}
    assert_bitwise(torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
                   meg_U[p + "self_attn.qkv_proj"][hand_qkv_rows(c)])
    q_blocks, k_seen, gate_blocks, up_blocks = [], {}, [], []
    hq, f = c.heads // c.tp, c.ffn // c.tp
    for r in range(c.tp):
        plan = plan_for(delta, "sglang", c.tp, r)
        got = {x.param: x for x in plan.factors}
        want = hf_to_sglang_rank(hf, c, r)
        for name in (p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"):
            assert got[name].cols is None
            assert_bitwise(got[name].U_OR, want[name], f"{name} rank {r}")
        for name, n_in in ((p + "self_attn.o_proj.weight", c.heads * c.d), (p + "mlp.down_proj.weight", c.ffn)):
            assert_bitwise(got[name].U_OR, meg_U[name[: -len(".weight")]])
            n = n_in // c.tp
            assert got[name].cols == (range(r * n, (r + 1) * n) if c.tp > 1 else None)
        dense = {e.param: e.tensor for e in plan.dense}
        for name in (p + "self_attn.qkv_proj.bias", p + "mlp.gate_up_proj.bias"):
            assert_bitwise(dense[name], want[name], f"{name} rank {r}")
        assert_bitwise(dense[p + "input_layernorm.weight"], hf[p + "input_layernorm.weight"])
        fused = got[p + "self_attn.qkv_proj.weight"].U_OR
        q_blocks.append(fused[: hq * c.d])
        kv = kv_heads_of(c, r)
        k_local = fused[hq * c.d : (hq + len(kv)) * c.d].reshape(len(kv), c.d, -1)
        for i, head in enumerate(kv):
            if head in k_seen:
                assert_bitwise(k_local[i], k_seen[head], f"replicated kv head {head}")
            k_seen[head] = k_local[i]
        gate_up = got[p + "mlp.gate_up_proj.weight"].U_OR
        gate_blocks.append(gate_up[:f])
        up_blocks.append(gate_up[f:])
    assert_bitwise(torch.cat(q_blocks), hf[p + "self_attn.q_proj.weight"])
    assert sorted(k_seen) == list(range(c.groups))
    assert_bitwise(torch.cat([k_seen[g] for g in range(c.groups)]).reshape(c.groups * c.d, -1),
                   hf[p + "self_attn.k_proj.weight"])
    assert_bitwise(torch.cat(gate_blocks), hf[p + "mlp.gate_proj.weight"])
    assert_bitwise(torch.cat(up_blocks), hf[p + "mlp.up_proj.weight"])
    meg_rows, hf_rows = sglang_qkv_rows(c.dims, c.tp, 0)
    if c.tp == 1:
        assert torch.equal(hf_rows, torch.arange(c.qkv_rows))
        assert torch.equal(sglang_gate_up_rows(2 * c.ffn, 1, 0), torch.arange(2 * c.ffn))
    assert hf_rows.tolist() == hand_sglang_qkv_rows(c, 0)
    assert meg_rows.tolist() == [hand_qkv_rows(c)[i] for i in hand_sglang_qkv_rows(c, 0)]


def _module_with(params: dict[str, torch.Tensor]) -> nn.Module:
    """An ``nn.Module`` tree whose ``named_parameters()`` are exactly ``params`` (dotted names)."""
    root = nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


def _hf_layer(c: Tiny, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    p = f"model.layers.{c.layer}."
    q, kv = c.heads * c.d, c.groups * c.d
    out = {p + "self_attn.q_proj.weight": _randn(q, c.hidden, gen=gen, dtype=dtype),
           p + "self_attn.k_proj.weight": _randn(kv, c.hidden, gen=gen, dtype=dtype),
           p + "self_attn.v_proj.weight": _randn(kv, c.hidden, gen=gen, dtype=dtype),
           p + "self_attn.o_proj.weight": _randn(c.hidden, q, gen=gen, dtype=dtype),
           p + "mlp.gate_proj.weight": _randn(c.ffn, c.hidden, gen=gen, dtype=dtype),
           p + "mlp.up_proj.weight": _randn(c.ffn, c.hidden, gen=gen, dtype=dtype),
           p + "mlp.down_proj.weight": _randn(c.hidden, c.ffn, gen=gen, dtype=dtype),
           p + "input_layernorm.weight": _randn(c.hidden, gen=gen, dtype=dtype)}
    return out


@settings(max_examples=150, **_FAST)
@given(c=tiny_configs(), seed=st.integers(0, 2**31), biases=st.booleans())
def test_engine_pieces_of_every_rank_reassemble_the_hf_tensors(c: Tiny, seed: int, biases: bool) -> None:
    """For a SGLang model sharded by hand at TP ``T``, the ranks' ``engine_pieces`` put every
    element of every HF tensor somewhere, replicated elements agree, and the reassembled tensors
    are the HF ones bit for bit."""
    event(f"engine TP {c.tp}" + (" (kv heads replicated)" if c.tp > c.groups else ""))
    gen = torch.Generator().manual_seed(seed)
    hf = _hf_layer(c, gen)
    p = f"model.layers.{c.layer}."
    if biases:
        for x, n in (("q", c.heads), ("k", c.groups), ("v", c.groups)):
            hf[p + f"self_attn.{x}_proj.bias"] = _randn(n * c.d, gen=gen)
        hf[p + "mlp.gate_proj.bias"] = _randn(c.ffn, gen=gen)
        hf[p + "mlp.up_proj.bias"] = _randn(c.ffn, gen=gen)
    full = {k: torch.full((v.shape[0] if v.dim() > 1 else 1, v[0].numel() if v.dim() > 1 else v.numel()), float("nan"))
            for k, v in hf.items()}
    for r in range(c.tp):
        model = _module_with(hf_to_sglang_rank(hf, c, r))
        model.tp_size, model.tp_rank = c.tp, r
        model._logra_attention = c.dims
        pieces = engine_pieces(model)
        assert set(pieces) == set(hf)
        for name, piece in pieces.items():
            assert piece.shape == tuple(hf[name].shape), name
            c0, c1 = piece.cols
            block = piece.mat[piece.local_rows]
            assert block.shape[1] == c1 - c0, name
            target = full[name][piece.rows, c0:c1]
            seen = ~torch.isnan(target)
            assert torch.equal(target[seen], block[seen]), f"{name}: replicated elements differ on rank {r}"
            full[name][piece.rows, c0:c1] = block
    for name, t in hf.items():
        assert_bitwise(full[name].reshape(t.shape), t, name)


@settings(max_examples=60, **_FAST)
@given(heads_per=st.integers(1, 4), groups=st.integers(1, 4), tp=st.integers(2, 8), ffn=st.integers(1, 8))
def test_an_engine_tp_that_does_not_fit_is_a_layout_error(heads_per: int, groups: int, tp: int, ffn: int) -> None:
    """A TP size the heads, kv heads or ffn do not fit is ``SyncError("layout")`` on every rank, never another error."""
    heads = heads_per * groups
    c = Tiny(heads, groups, 2, 4, ffn, tp, 0)
    fits = engine_tp_fits(heads, groups, tp) and ffn % tp == 0
    delta = layer_delta(c, 2, 0, biases=False)
    for r in range(tp):
        if fits:
            plan_for(delta, "sglang", tp, r)
        else:
            with pytest.raises(SyncError) as exc:
                plan_for(delta, "sglang", tp, r)
            assert exc.value.kind == "layout"


# --------------------------------------------------------------------------- applying a delta commutes with the maps


_MEGATRON_OF = {"self_attn.qkv_proj": "self_attention.linear_qkv", "self_attn.o_proj": "self_attention.linear_proj",
                "mlp.gate_up_proj": "mlp.linear_fc1", "mlp.down_proj": "mlp.linear_fc2"}


@settings(max_examples=200, **_FAST)
@given(c=tiny_configs(), rank=st.integers(1, 6), seed=st.integers(0, 2**31),
       distribution=st.sampled_from(DISTRIBUTIONS), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       decay=st.one_of(st.just(1.0), st.floats(0.5, 1.0, exclude_min=True)))
def test_applied_delta_commutes_with_the_layout_maps(c: Tiny, rank: int, seed: int, distribution: str,
                                                     dtype: torch.dtype, decay: float) -> None:
    """``W ← decay·W − U·A`` merged on Megatron-layout weights and then mapped to HF equals the
    delta applied in HF layout, which, sharded by hand, equals each SGLang rank's own apply --
    bit for bit with Rademacher projections, to fp32 rounding with Gaussian ones -- and every
    result is within rounding of the float64 ``decay·W − U·A``."""
    delta = layer_delta(c, rank, seed, distribution=distribution, decay=decay, biases=False)
    gen = torch.Generator().manual_seed(seed + 1)
    hf_before = _hf_layer(c, gen, dtype)
    hf_before.pop(f"model.layers.{c.layer}.input_layernorm.weight")
    mcfg = _mcfg(c)
    pre, mpre = f"model.layers.{c.layer}.", f"decoder.layers.{c.layer}."
    meg = {  # the same weights in Megatron layout
        "self_attn.qkv_proj": fuse_qkv(*(hf_before[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"), mcfg),
        "self_attn.o_proj": hf_before[pre + "self_attn.o_proj.weight"].clone(),
        "mlp.gate_up_proj": torch.cat([hf_before[pre + "mlp.gate_proj.weight"], hf_before[pre + "mlp.up_proj.weight"]]),
        "mlp.down_proj": hf_before[pre + "mlp.down_proj.weight"].clone(),
    }
    eps = 2.0**-23 if dtype == torch.float32 else 2.0**-7
    bound_meg: dict[str, torch.Tensor] = {}
    for t in delta.targets:
        kind = t.name[len(pre):]
        A = projection(delta.seed, t.name, delta.update_index, rank, t.n_in, distribution=distribution)
        W64, U64, A64 = meg[kind].double(), t.U_OR.double(), A.double()
        reference = decay * W64 - U64 @ A64
        bound_meg[kind] = (rank + 4) * eps * ((decay * W64).abs() + U64.abs() @ A64.abs()) + 1e-30
        low_rank_merge_(meg[kind], t.U_OR, A, decay=decay, distribution=distribution)
        assert _within(meg[kind], reference, bound_meg[kind]), f"{kind} is not decay·W − U·A"

    hf_after = {k: v.clone() for k, v in hf_before.items()}
    assert apply_delta_(hf_after, delta, 0, layout="hf") == 1
    exact = distribution == "rademacher"
    bound_hf: dict[str, torch.Tensor] = {}
    for kind, w in meg.items():
        name = f"{mpre}{_MEGATRON_OF[kind]}.weight"
        bound_hf.update(megatron_param_to_hf(name, 2 * bound_meg[kind], c.dims))
        for hf_name, mapped in megatron_param_to_hf(name, w, c.dims):
            if exact:
                assert_bitwise(hf_after[hf_name], mapped, hf_name)
            else:
                assert _within(hf_after[hf_name], mapped, bound_hf[hf_name]), hf_name

    for r in range(c.tp):
        engine = hf_to_sglang_rank(hf_before, c, r)
        apply_delta_(engine, delta, 0, layout="sglang", tp_size=c.tp, tp_rank=r)
        want, bound = hf_to_sglang_rank(hf_after, c, r), hf_to_sglang_rank(bound_hf, c, r)
        assert set(engine) == set(want)
        for name, w in engine.items():
            if exact:
                assert_bitwise(w, want[name], f"{name} rank {r}")
            else:
                assert _within(w, want[name], bound[name]), f"{name} rank {r}"
