"""Megatron <-> HF layout map (``megatron_logra.models.hf``) against real megatron-core and transformers models.

Each case builds a tiny fp32 megatron-core GPT, perturbs the 1-D parameters (norm weights
init to 1 and biases to 0, which would hide a swapped or misplaced norm/bias), gathers the full
state, maps it to HF names, loads it into the transformers causal LM of
``hf_config_from_model_config`` and compares logits on the same tokens.

Tolerance: both models evaluate the same fp32 network with differently ordered operations
(fused vs separate QKV GEMMs, different RoPE / RMSNorm kernels). fp32 unit roundoff is
u = 2⁻²⁴ ≈ 6e-8; each logit goes through a few layers of dot products of length K ≤ 192, whose
worst-case relative error is γ_K ≈ K·u ≈ 1.1e-5 (typical √K·u ≈ 1e-6). We require
``|Δlogit| <= 1e-5 · max|logit|`` (observed ≈ 5e-7 relative); a wrong row permutation, a swapped
gate/up or a misplaced norm changes logits at O(1) relative.
"""

from __future__ import annotations

import warnings

import pytest
import torch

# Resolve transformers' lazy model modules before megatron_logra.cpu_shim patches torch.cuda.Stream.
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from megatron_logra.models.gpt import PADDED_LOGIT, ModelConfig, build_gpt
from megatron_logra.models.hf import (
    fuse_qkv,
    hf_config_from_model_config,
    hf_shapes,
    hf_to_megatron,
    megatron_shapes,
    megatron_to_hf,
    split_qkv,
)
from megatron_logra.models.layout import gather_full_state

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")
REL_TOL = 1e-5

CASES = {
    "mha_untied": dict(vocab_size=50),
    "gqa": dict(num_attention_heads=8, num_query_groups=2),
    "tied": dict(untie_embeddings_and_output_weights=False, num_query_groups=2),
    "qwen2_qkv_bias": dict(add_qkv_bias=True, num_query_groups=2),
    "qwen3_qk_layernorm": dict(qk_layernorm=True, num_query_groups=2, rotary_base=500000),
    "llama_bias_linear": dict(add_bias_linear=True, num_query_groups=1),
}
HF_CLASS = {
    "mha_untied": LlamaForCausalLM, "gqa": LlamaForCausalLM, "tied": LlamaForCausalLM,
    "qwen2_qkv_bias": Qwen2ForCausalLM, "qwen3_qk_layernorm": Qwen3ForCausalLM, "llama_bias_linear": LlamaForCausalLM,
}


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=64,
                seq_length=32, init_std=0.1, layernorm_epsilon=1e-5)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""

def _megatron(cfg: ModelConfig, groups, seed: int = 7):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(cfg, groups, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _hf_model(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config_from_model_config(cfg), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert unexpected == []
    tied = not cfg.untie_embeddings_and_output_weights
    assert sorted(missing) == (["lm_head.weight"] if tied else [])
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_megatron(case, groups):
    cfg = _cfg(**CASES[case])
    mg = _megatron(cfg, groups)
    state = gather_full_state(mg, groups.tp)
    assert {k: tuple(v.shape) for k, v in state.items()} == megatron_shapes(cfg)  # real megatron names

    hf_state = megatron_to_hf(state, cfg)
    assert {k: tuple(v.shape) for k, v in hf_state.items()} == hf_shapes(cfg)
    hf = _hf_model(cfg, hf_state)
    assert type(hf) is HF_CLASS[case]

    tokens = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with torch.no_grad():
        ref = mg(tokens, positions, None)  # megatron-core returns [b, s, V] when labels is None
        out = hf(input_ids=tokens).logits
    assert ref.shape == out.shape == (3, 17, cfg.padded_vocab_size())
    if cfg.padded_vocab_size() > cfg.vocab_size:  # the trainer masks its padded columns (the engine does too)
        assert (ref[..., cfg.vocab_size:] == PADDED_LOGIT).all()
    ref, out = ref[..., : cfg.vocab_size], out[..., : cfg.vocab_size]
    scale = ref.abs().max().item()
    assert scale > 0.5  # logits are O(1), so the relative bound is meaningful
    err = (ref - out).abs().max().item()
    assert err <= REL_TOL * scale, f"{case}: max |Δlogit| {err:.3g} > {REL_TOL} × {scale:.3g}"

    back = hf_to_megatron(hf_state, cfg)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    again = megatron_to_hf(back, cfg)
    assert all(torch.equal(again[k], v) for k, v in hf_state.items())


def test_qkv_rows_follow_megatron_group_interleave():
    """Expected rows computed head by head from the layout rule, independently of the reshape code."""
    cfg = _cfg(num_attention_heads=8, num_query_groups=2, hidden_size=32)
    heads, groups_, d = 8, 2, 4
    per = heads // groups_
    rows = groups_ * (per + 2) * d
    fused = torch.arange(rows, dtype=torch.float64)[:, None].repeat(1, 3)  # row r holds value r
    q, k, v = split_qkv(fused, cfg)
    exp_q = [g * (per + 2) * d + (j % per) * d + t for j in range(heads) for g in [j // per] for t in range(d)]
    exp_k = [g * (per + 2) * d + per * d + t for g in range(groups_) for t in range(d)]
    exp_v = [g * (per + 2) * d + (per + 1) * d + t for g in range(groups_) for t in range(d)]
    assert q[:, 0].long().tolist() == exp_q
    assert k[:, 1].long().tolist() == exp_k
    assert v[:, 2].long().tolist() == exp_v
    assert torch.equal(fuse_qkv(q, k, v, cfg), fused)
    qb, kb, vb = split_qkv(fused[:, 0], cfg)  # bias layout
    assert qb.long().tolist() == exp_q and kb.long().tolist() == exp_k and vb.long().tolist() == exp_v


def test_outputs_do_not_alias_inputs():
    cfg = _cfg(num_layers=1)
    state = {k: torch.randn(s) for k, s in megatron_shapes(cfg).items()}
    hf_state = megatron_to_hf(state, cfg)
    before = {k: v.clone() for k, v in hf_state.items()}
    for t in state.values():
        t.zero_()
    assert all(torch.equal(hf_state[k], before[k]) for k in before)


def test_hf_config_fields():
    cfg = _cfg(vocab_size=50, num_attention_heads=8, num_query_groups=2, rotary_base=123456, layernorm_epsilon=3e-6)
    hc = hf_config_from_model_config(cfg)
    assert type(hc).__name__ == "LlamaConfig"
    assert hc.vocab_size == 64 and hf_config_from_model_config(cfg, tp=8).vocab_size == 128  # padded, not 50
    assert (hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers) == (64, 96, 2)
    assert (hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim) == (8, 2, 8)
    assert hc.max_position_embeddings == 32 and hc.rms_norm_eps == 3e-6
    assert hc.rope_parameters["rope_theta"] == 123456.0 and hc.tie_word_embeddings is False
    assert hf_config_from_model_config(_cfg()).num_key_value_heads == 4  # MHA: groups = heads
    assert type(hf_config_from_model_config(_cfg(add_qkv_bias=True))).__name__ == "Qwen2Config"
    assert type(hf_config_from_model_config(_cfg(qk_layernorm=True))).__name__ == "Qwen3Config"


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(swiglu=False), "swiglu"),
        (dict(normalization="LayerNorm"), "normalization"),
        (dict(position_embedding_type="learned_absolute"), "position_embedding_type"),
        (dict(qk_layernorm=True, add_qkv_bias=True), "add_qkv_bias"),
    ],
)
def test_unsupported_configs_raise(kw, field):
    cfg = _cfg(**kw)
    for fn in (hf_config_from_model_config, megatron_shapes, hf_shapes):
        with pytest.raises(ValueError, match=f"model.{field}"):
            fn(cfg)


def test_unknown_missing_and_misshaped_names_raise():
    cfg = _cfg(untie_embeddings_and_output_weights=False)
    state = {k: torch.zeros(s) for k, s in megatron_shapes(cfg).items()}
    megatron_to_hf(state, cfg)  # the valid state passes

    extra = dict(state, **{"decoder.layers.2.mlp.linear_fc1.weight": torch.zeros(192, 64)})  # layer 2 of 2
    with pytest.raises(ValueError, match=r"unknown names \['decoder\.layers\.2\.mlp\.linear_fc1\.weight'\]"):
        megatron_to_hf(extra, cfg)
    missing = {k: v for k, v in state.items() if k != "decoder.layers.1.pre_mlp_layernorm.weight"}
    with pytest.raises(ValueError, match=r"missing names \['decoder\.layers\.1\.pre_mlp_layernorm\.weight'\]"):
        megatron_to_hf(missing, cfg)
    bad = dict(state, **{"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(191, 64)})
    with pytest.raises(ValueError, match="linear_qkv.weight"):
        megatron_to_hf(bad, cfg)

    hf_state = megatron_to_hf(state, cfg)
    with pytest.raises(ValueError, match=r"unknown names \['lm_head\.weight'\]"):  # tied: no lm_head
        hf_to_megatron(dict(hf_state, **{"lm_head.weight": torch.zeros(64, 64)}), cfg)
    with pytest.raises(ValueError, match=r"missing names \['model\.layers\.0\.mlp\.up_proj\.weight'\]"):
        hf_to_megatron({k: v for k, v in hf_state.items() if k != "model.layers.0.mlp.up_proj.weight"}, cfg)


def test_vocab_padding_follows_trainer_tp():
    cfg = _cfg(vocab_size=70, num_layers=1)  # padded: 80 at TP=1, 96 at TP=2
    state2 = {k: torch.randn(s) for k, s in megatron_shapes(cfg, tp=2).items()}
    assert state2["embedding.word_embeddings.weight"].shape[0] == 96
    hf_state = megatron_to_hf(state2, cfg, tp=2)
    assert hf_state["lm_head.weight"].shape[0] == hf_config_from_model_config(cfg, tp=2).vocab_size == 96
    assert all(torch.equal(v, state2[k]) for k, v in hf_to_megatron(hf_state, cfg, tp=2).items())
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight"):
        megatron_to_hf(state2, cfg)  # TP=1 padding expects 80 rows
