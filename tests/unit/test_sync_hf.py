"""Sketch deltas applied to real ``transformers`` models (Llama, Qwen2) built locally from a config.

Reference per HF projection: ``W0 − U_p·A`` in float64, where ``U_p`` is cut out of the
Megatron-order ``U`` with explicit per-group loops and ``A`` is regenerated from the canonical
layer name (q/k/v share the ``qkv_proj`` projection, gate/up share ``gate_up_proj``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sketch.random_projection import projection
from megatron_logra.sync import InProcessTransport, ModuleEngine
from megatron_logra.sync.synthetic import DenseShape, random_delta
from support.merge_reference import rademacher_product_reference

transformers = pytest.importorskip("transformers")

RANK = 8


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _build(kind: str, dtype=torch.float32):
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(use_sliding_window=False, **common))
    return model.to(dtype).eval()


def _per_projection_U(delta, layer, H=4, G=2, d=8, f=48):
    U = {t.name: t.U_OR for t in delta.targets}
    p = f"model.layers.{layer}."
    qkv, gu = U[p + "self_attn.qkv_proj"], U[p + "mlp.gate_up_proj"]
    q, k, v = [], [], []
    per = H // G
    for g in range(G):
        base = g * (per + 2) * d
        q.append(qkv[base : base + per * d])
        k.append(qkv[base + per * d : base + (per + 1) * d])
        v.append(qkv[base + (per + 1) * d : base + (per + 2) * d])
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", torch.cat(q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", torch.cat(k)),
        "self_attn.v_proj": ("self_attn.qkv_proj", torch.cat(v)),
        "self_attn.o_proj": ("self_attn.o_proj", U[p + "self_attn.o_proj"]),
        "mlp.gate_proj": ("mlp.gate_up_proj", gu[:f]),
        "mlp.up_proj": ("mlp.gate_up_proj", gu[f:]),
        "mlp.down_proj": ("mlp.down_proj", U[p + "mlp.down_proj"]),
    }


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_delta_on_a_transformers_model_equals_naive_per_projection(kind):
    model = _build(kind)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    shape = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40, qkv_bias=kind == "qwen2")
    dense = {"model.layers.0.post_attention_layernorm.weight": torch.randn(32)}
    if kind == "qwen2":
        dense.update({f"model.layers.1.self_attn.{p}_proj.bias": torch.randn(32 if p == "q" else 16) for p in "qkv"})
    delta = random_delta(shape, RANK, seed=21, update_index=6, scale=0.05, dense=dense)
    engine = ModuleEngine(model)
    assert InProcessTransport(engine).send(delta) == 1
    params = dict(model.named_parameters())
    for layer in range(2):
        for proj, (target, U_p) in _per_projection_U(delta, layer).items():
            name = f"model.layers.{layer}.{proj}.weight"
            n_in = before[name].shape[1]
            A = projection(21, f"model.layers.{layer}.{target}", 6, RANK, n_in)
            expect = before[name].double() - U_p.double() @ A.double()
            torch.testing.assert_close(params[name].detach().double(), expect, rtol=0, atol=2e-6)
            assert (params[name].detach() - before[name]).abs().max() > 1e-3, name
    for name, value in dense.items():
        assert torch.equal(params[name].detach(), value), name
    untouched = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"]
    for name in untouched:
        assert torch.equal(params[name].detach(), before[name]), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 2]])).logits
    assert torch.isfinite(logits).all()


def test_bf16_transformers_model_gets_the_documented_rounding():
    model = _build("llama", torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    shape = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40)
    delta = random_delta(shape, RANK, seed=2, scale=0.05)
    ModuleEngine(model).apply_sketch_delta(delta)
    for proj, (target, U_p) in _per_projection_U(delta, 1).items():
        name = f"model.layers.1.{proj}.weight"
        A = projection(2, f"model.layers.1.{target}", 0, RANK, before[name].shape[1])
        P = rademacher_product_reference(U_p, A)  # grid(s·U)·sign(A), exact
        expect = (before[name].float() - P).bfloat16()
        assert torch.equal(dict(model.named_parameters())[name].detach(), expect), name
