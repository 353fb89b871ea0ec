"""Layout mapping of a sketch delta onto engines (HF, SGLang at TP 1/2/4) and across TP degrees.

Independent references: ``models.hf.split_qkv``/``fuse_qkv`` (the checkpoint converter) for the
QKV permutation; SGLang sharding written out here head by head; Megatron trainer shards made
with ``models.layout.shard_full`` from parameters carrying megatron's partition attributes.
The claim checked bitwise: applying each rank's share of the delta equals applying the full
delta and then sharding, for trainer TP 2 -> engine TP 1 and trainer TP 1 -> engine TP 2.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import fuse_qkv, split_qkv
from megatron_logra.models.layout import shard_full, unshard
from megatron_logra.sketch.random_projection import projection
from megatron_logra.sync.apply import apply_delta_, low_rank_merge_, quantize_factor
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import megatron_rows_from_hf, plan_for, qkv_rows_hf
from megatron_logra.sync.synthetic import DenseShape, random_delta


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


RANK = 8
# 8 query heads, 2 kv groups, head dim 4: TP 4 replicates each kv head on two ranks
SHAPE = DenseShape(hidden=32, layers=2, heads=8, kv_heads=2, ffn=48, vocab=40, qkv_bias=True)
H, G, D, F, V = 8, 2, 4, 48, 40


def _mcfg(heads, groups, d):
    return ModelConfig(hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups)


@pytest.mark.parametrize("heads,groups,d", [(8, 2, 4), (4, 4, 3), (6, 1, 2), (12, 4, 5)])
def test_qkv_rows_agree_with_the_checkpoint_converter(heads, groups, d):
    fused = torch.randn((heads + 2 * groups) * d, 5)
    q, k, v = split_qkv(fused, _mcfg(heads, groups, d))
    rows = qkv_rows_hf(AttentionDims(heads, groups, d))
    assert torch.equal(fused[rows["q"]], q) and torch.equal(fused[rows["k"]], k) and torch.equal(fused[rows["v"]], v)
    hf = torch.cat([q, k, v])
    assert torch.equal(hf[megatron_rows_from_hf(AttentionDims(heads, groups, d))], fuse_qkv(q, k, v, _mcfg(heads, groups, d)))


# --------------------------------------------------------------------------- SGLang sharding by hand


def _kv_heads_of(rank, tp):
    return list(range(rank * G // tp, (rank + 1) * G // tp)) if G >= tp else [rank // (tp // G)]


def _heads_rows(heads, d, offset=0):
    return [offset + h * d + t for h in heads for t in range(d)]


def _shard_sglang(full: dict[str, torch.Tensor], tp: int, rank: int, vocab_local: int) -> dict[str, torch.Tensor]:
    """SGLang Llama layout of one TP rank, written out head by head."""
    out = {}
    qh = list(range(rank * H // tp, (rank + 1) * H // tp))
    kvh = _kv_heads_of(rank, tp)
    qkv_rows = _heads_rows(qh, D) + _heads_rows(kvh, D, H * D) + _heads_rows(kvh, D, H * D + G * D)
    f = F // tp
    for name, w in full.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            out[name] = w[qkv_rows].clone()
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat([w[rank * f : (rank + 1) * f], w[F + rank * f : F + (rank + 1) * f]])
        elif name.endswith("o_proj.weight"):
            n = H * D // tp
            out[name] = w[:, rank * n : (rank + 1) * n].clone()
        elif name.endswith("down_proj.weight"):
            out[name] = w[:, rank * f : (rank + 1) * f].clone()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            local = torch.full((vocab_local, w.shape[1]), 7.0)  # padding rows keep their (arbitrary) values
            rows = w[rank * vocab_local : (rank + 1) * vocab_local]
            local[: rows.shape[0]] = rows
            out[name] = local
        else:
            out[name] = w.clone()
    return out


def _full_sglang(seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(V, 32, generator=gen), "lm_head.weight": torch.randn(V, 32, generator=gen),
           "model.norm.weight": torch.randn(32, generator=gen)}
    for i in range(SHAPE.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.qkv_proj.weight": torch.randn((H + 2 * G) * D, 32, generator=gen),
            p + "self_attn.qkv_proj.bias": torch.randn((H + 2 * G) * D, generator=gen),
            p + "self_attn.o_proj.weight": torch.randn(32, H * D, generator=gen),
            p + "mlp.gate_up_proj.weight": torch.randn(2 * F, 32, generator=gen),
            p + "mlp.down_proj.weight": torch.randn(32, F, generator=gen),
            p + "input_layernorm.weight": torch.randn(32, generator=gen),
            p + "post_attention_layernorm.weight": torch.randn(32, generator=gen),
        })
    return out


def _dense_for_delta(seed=1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = {"model.norm.weight": torch.randn(32, generator=gen), "lm_head.weight": torch.randn(V, 32, generator=gen)}
    for p in ("q", "k", "v"):
        dense[f"model.layers.1.self_attn.{p}_proj.bias"] = torch.randn((H if p == "q" else G) * D, generator=gen)
    return dense


@pytest.mark.parametrize("tp,vocab_local", [(2, 20), (4, 10), (2, 24)])  # 24: vocab padded to 48 rows
def test_sglang_per_rank_apply_equals_full_apply_then_shard(tp, vocab_local):
    delta = random_delta(SHAPE, RANK, scale=0.05, dense=_dense_for_delta(), seed=3, update_index=7)
    full = _full_sglang()
    reference = {k: v.clone() for k, v in full.items()}
    apply_delta_(reference, delta, 0, layout="sglang")
    assert not torch.equal(reference["model.layers.0.self_attn.o_proj.weight"], full["model.layers.0.self_attn.o_proj.weight"])
    q_b = delta.dense["model.layers.1.self_attn.q_proj.bias"]
    assert torch.equal(reference["model.layers.1.self_attn.qkv_proj.bias"][: H * D], q_b)
    for rank in range(tp):
        shard = _shard_sglang(full, tp, rank, vocab_local)
        apply_delta_(shard, delta, 0, layout="sglang", tp_size=tp, tp_rank=rank)
        expect = _shard_sglang(reference, tp, rank, vocab_local)
        for name in expect:
            assert torch.equal(shard[name], expect[name]), f"rank {rank}/{tp}: {name}"


def test_sglang_full_layout_equals_hf_layout_fused_by_hand():
    delta = random_delta(SHAPE, RANK, scale=0.05, seed=9)
    sg = _full_sglang()
    hf = {}
    for name, w in sg.items():
        if "qkv_proj.weight" in name:
            pre = name.replace("qkv_proj.weight", "")
            hf[pre + "q_proj.weight"], hf[pre + "k_proj.weight"], hf[pre + "v_proj.weight"] = (
                w[: H * D].clone(), w[H * D : H * D + G * D].clone(), w[H * D + G * D :].clone())
        elif "gate_up_proj.weight" in name:
            pre = name.replace("gate_up_proj.weight", "")
            hf[pre + "gate_proj.weight"], hf[pre + "up_proj.weight"] = w[:F].clone(), w[F:].clone()
        elif "qkv_proj.bias" not in name:
            hf[name] = w.clone()
    apply_delta_(sg, delta, 0, layout="sglang")
    apply_delta_(hf, delta, 0, layout="hf")
    for i in range(SHAPE.layers):
        p = f"model.layers.{i}."
        fused = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(sg[p + "self_attn.qkv_proj.weight"], fused)
        assert torch.equal(sg[p + "mlp.gate_up_proj.weight"], torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
        assert torch.equal(sg[p + "mlp.down_proj.weight"], hf[p + "mlp.down_proj.weight"])


def test_layout_errors_are_named():
    delta = random_delta(SHAPE, RANK)
    with pytest.raises(SyncError, match="unknown engine layout 'vllm'"):
        plan_for(delta, "vllm")
    with pytest.raises(SyncError, match="hf layout is unsharded"):
        plan_for(delta, "hf", tp_size=2)
    with pytest.raises(SyncError, match="num_heads=8 is not divisible by the engine TP size 3"):
        plan_for(delta, "sglang", tp_size=3, tp_rank=0)
    odd = random_delta(SHAPE, RANK, dense={"model.layers.0.self_attn.k_proj.bias": torch.zeros(G * D)})
    with pytest.raises(SyncError, match="without its q_proj.bias"):
        plan_for(odd, "sglang", tp_size=2, tp_rank=0)


# --------------------------------------------------------------------------- trainer TP <-> engine TP


class _MegatronParam:
    """Stand-in carrying megatron-core's partition attributes (what shard_full/unshard read)."""

    def __init__(self, dim, stride=1):
        self.tensor_model_parallel, self.partition_dim, self.partition_stride = True, dim, stride


_PARAMS = {"qkv": _MegatronParam(0), "fc1": _MegatronParam(0, stride=2), "proj": _MegatronParam(1), "fc2": _MegatronParam(1)}
_CANON = {"qkv": "self_attn.qkv_proj", "proj": "self_attn.o_proj", "fc1": "mlp.gate_up_proj", "fc2": "mlp.down_proj"}


def _megatron_full(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"qkv": ((H + 2 * G) * D, 32), "proj": (32, H * D), "fc1": (2 * F, 32), "fc2": (32, F)}
    return {(i, k): torch.randn(*s, generator=gen) for i in range(SHAPE.layers) for k, s in shapes.items()}


def _trainer_step(weights, tp, seed=4):
    """One trainer step at TP ``tp``: local bf16 factors, per-shard merge, wire delta gathered like build_delta."""
    gen = torch.Generator().manual_seed(seed)
    targets = []
    for (i, kind), shards in weights.items():
        name = f"model.layers.{i}.{_CANON[kind]}"
        n_out = shards[0].shape[0] * (tp if kind in ("qkv", "fc1") else 1)
        n_in = shards[0].shape[1] * (tp if kind in ("proj", "fc2") else 1)
        U_full = quantize_factor(torch.randn(n_out, RANK, generator=gen) * 0.05)
        local_U = [shard_full(U_full, name, _PARAMS[kind], r, tp) if kind in ("qkv", "fc1") else U_full for r in range(tp)]
        for r in range(tp):
            cols = range(r * n_in // tp, (r + 1) * n_in // tp) if kind in ("proj", "fc2") and tp > 1 else None
            A = projection(2, name, 5, RANK, n_in, cols=cols)
            low_rank_merge_(shards[r], local_U[r], A)
        wire_U = unshard(local_U, _PARAMS[kind]) if kind in ("qkv", "fc1") else local_U[0]
        assert torch.equal(wire_U.view(torch.int16), U_full.view(torch.int16))
        targets.append(TargetFactor(name, wire_U, n_in, {"qkv": "qkv_interleaved", "fc1": "gate_up"}.get(kind, "row_parallel")))
    return SketchDelta(0, 1, 2, 5, RANK, "rademacher", targets, attention=AttentionDims(H, G, D))


def _megatron_to_hf(full):
    out = {}
    for (i, kind), w in full.items():
        p = f"model.layers.{i}."
        if kind == "qkv":
            q, k, v = split_qkv(w, _mcfg(H, G, D))
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v})
        elif kind == "fc1":
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = (x.clone() for x in w.chunk(2))
        else:
            out[p + ("self_attn.o_proj.weight" if kind == "proj" else "mlp.down_proj.weight")] = w.clone()
    return out


def test_trainer_tp2_to_engine_tp1_is_bitwise():
    full = _megatron_full()
    engine = _megatron_to_hf(full)
    trainer = {key: [shard_full(w, str(key), _PARAMS[key[1]], r, 2).clone() for r in range(2)] for key, w in full.items()}
    delta = _trainer_step(trainer, tp=2)
    apply_delta_(engine, delta, 0, layout="hf")
    gathered = {key: unshard(shards, _PARAMS[key[1]]) for key, shards in trainer.items()}
    expect = _megatron_to_hf(gathered)
    assert set(expect) == set(engine)
    for name in expect:
        assert torch.equal(engine[name], expect[name]), name
        assert not torch.equal(engine[name], _megatron_to_hf(full)[name])


def test_trainer_tp1_to_engine_tp2_is_bitwise():
    full = _megatron_full(seed=1)
    trainer = {key: [w.clone()] for key, w in full.items()}
    delta = _trainer_step(trainer, tp=1, seed=8)
    hf_after = _megatron_to_hf({key: s[0] for key, s in trainer.items()})
    sg_before = {}
    for name, w in _megatron_to_hf(full).items():
        if name.endswith("q_proj.weight"):
            pre = name[: -len("q_proj.weight")]
            sg_before[pre + "qkv_proj.weight"] = torch.cat([_megatron_to_hf(full)[pre + f"{x}_proj.weight"] for x in "qkv"])
        elif name.endswith("gate_proj.weight"):
            pre = name[: -len("gate_proj.weight")]
            sg_before[pre + "gate_up_proj.weight"] = torch.cat([w, _megatron_to_hf(full)[pre + "up_proj.weight"]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            sg_before[name] = w
    sg_after = {}
    for name in sg_before:
        if name.endswith("qkv_proj.weight"):
            pre = name[: -len("qkv_proj.weight")]
            sg_after[name] = torch.cat([hf_after[pre + f"{x}_proj.weight"] for x in "qkv"])
        elif name.endswith("gate_up_proj.weight"):
            pre = name[: -len("gate_up_proj.weight")]
            sg_after[name] = torch.cat([hf_after[pre + "gate_proj.weight"], hf_after[pre + "up_proj.weight"]])
        else:
            sg_after[name] = hf_after[name]
    for rank in range(2):
        shard = _shard_sglang(sg_before, 2, rank, V // 2)
        apply_delta_(shard, delta, 0, layout="sglang", tp_size=2, tp_rank=rank)
        expect = _shard_sglang(sg_after, 2, rank, V // 2)
        for name in expect:
            assert torch.equal(shard[name], expect[name]), f"rank {rank}: {name}"
