"""HF <-> megatron-core conversion (``megatron_logra.convert``) on random tiny transformers models.

Models are built locally from config objects (no download): Llama (GQA 8/2, untied), Qwen2 (QKV bias,
tied), Qwen3 (q/k norms, untied, RoPE base 5e5), Qwen3 with one KV group (tied) and Mistral without a
sliding window (untied), fp32, vocabulary 70 (padded to 80 at TP=1 and 96 at TP=2), saved as one file
or sharded at 40 KB so that the q/k/v and gate/up parts of one fused megatron tensor sit in different
shards. Measured here: max|Δlogit| / max|logit| between 5.7e-7 and 8.4e-7.

Logit tolerance (HF loaded into megatron-core vs transformers, same fp32 weights): as in
``test_hf_mapping``, ``|Δlogit| <= 1e-5 · max|logit|`` — fp32 roundoff u = 2⁻²⁴ through dot products
of length K ≤ 96 bounds the relative error by about K·u ≈ 6e-6; a wrong row permutation, swapped
gate/up or misplaced norm changes logits at O(1). Conversions themselves are exact: every comparison
of converted tensors is ``torch.equal``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from support import forked
import torch

import torch.utils._device

# megatron_logra.cpu_shim wraps torch factories (torch.empty, torch.arange, ...). torch caches the set of
# factories that ``with torch.device("meta")`` redirects on first use; filled after the shim, it holds the
# wrappers, meta-device init silently builds real uninitialised tensors and transformers' from_pretrained
# leaves rotary inv_freq as garbage. Fill the cache first (the shim itself should do this).
torch.utils._device._device_constructors()
# Resolve transformers' lazy model modules before megatron_logra.cpu_shim patches torch.cuda.Stream.
from transformers import (  # noqa: F401,E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from safetensors.torch import load_file, save_file

from megatron_logra.convert import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    load_hf_into_model,
    load_mcore_into_model,
    megatron_plan,
    model_config_from_hf,
)
from megatron_logra.convert.tensor_plan import partition_of
from megatron_logra.models.gpt import PADDED_LOGIT, ModelConfig, build_gpt
from megatron_logra.models.layout import shard_full

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")
REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "megatron_logra" / "assets" / "warm_start_tiny" / "tokenizer"
REL_TOL = 1e-5
V = 70
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CASES = {
    "llama_gqa_untied": (LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False), True),
    "qwen2_bias_tied": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), False),
    "qwen3_norm_untied": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), True),
    "qwen3_mqa_tied": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                         tie_word_embeddings=True), False),
    # head_dim != hidden / heads (as in Qwen3-0.6B ... 32B): megatron kv_channels
    "qwen3_wide_heads": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                           tie_word_embeddings=False), False),
    "mistral_untied": (MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                           tie_word_embeddings=False), False),
    # Llama 3.1's RoPE scaling: head_dim 16 at base 5e5 has wavelengths below 2048, between 2048 and 8192
    # (smoothed) and above 8192 (divided by the factor), so each branch of the scaling is exercised
    "llama3_rope_scaled": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                              "factor": 8.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 8192}), False),
}
BASE = ModelConfig(seq_length=64, params_dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _make_hf(root: Path, case: str):
    cls, kw, sharded = CASES[case]
    config = cls(**COMMON, **kw)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "mistral": "MistralForCausalLM"}[config.model_type]]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    with torch.no_grad():  # O(1) logits; perturbed norms and biases catch misplaced 1-D tensors
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    out = root / case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out, max_shard_size="40KB" if sharded else "1GB")
    for f in TOKENIZER.iterdir():
        shutil.copyfile(f, out / f.name)
    return out, model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {case: _make_hf(root, case) for case in CASES}


def _hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _megatron(cfg: ModelConfig, groups):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt(cfg, groups, seed=3).eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1])[None].expand_as(tokens), None)


# ------------------------------------------------------------------------------------------ plan vs megatron-core
@pytest.mark.parametrize("kw", [dict(num_query_groups=2), dict(add_bias_linear=True, untie_embeddings_and_output_weights=False),
                                dict(add_qkv_bias=True, qk_layernorm=False), dict(qk_layernorm=True, num_query_groups=1)])
def test_plan_matches_build_gpt(kw, groups):
    """Names, shapes and TP partition (dim, stride) of the static plan equal the real megatron-core model's."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=V, **kw)
    model = _megatron(cfg, groups)
    plan = megatron_plan(cfg, 1, 1)
    params = dict(model.named_parameters())
    assert sorted(e.local_name for e in plan) == sorted(params)
    for e in plan:
        p = params[e.local_name]
        assert e.shape == tuple(p.shape), e.name
        actual = (p.partition_dim, p.partition_stride) if getattr(p, "tensor_model_parallel", False) else None
        assert actual == e.partition == partition_of(e.name), e.name
    # pipeline stages: local names restart at 0, embedding first, head last (and tied: a copy on the last stage)
    tied = megatron_plan(dataclasses.replace(cfg, num_layers=4, num_query_groups=2,
                                             untie_embeddings_and_output_weights=False), 2, 2)
    last = [e for e in tied if e.pp_rank == 1]
    assert last[0].local_name.startswith("decoder.layers.0.") and last[0].name.startswith("decoder.layers.2.")
    assert [e.name for e in last[-2:]] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert last[-1].sources == ("model.embed_tokens.weight",) and last[-1].shape == (96, 64)


@pytest.mark.parametrize("kw", [dict(), dict(add_bias_linear=True), dict(add_qkv_bias=True, qk_layernorm=False),
                                dict(qk_layernorm=True, untie_embeddings_and_output_weights=False)])
def test_hf_sources_partition_the_hf_state(kw):
    """Every HF tensor is the source of exactly one megatron tensor (hf.hf_sources vs hf.hf_shapes)."""
    from megatron_logra.models.hf import hf_shapes, hf_sources, megatron_shapes

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, **kw)
    used = [s for name in megatron_shapes(cfg) for s in hf_sources(name)]
    assert sorted(used) == sorted(hf_shapes(cfg)) and len(used) == len(set(used))
    with pytest.raises(ValueError, match="no HF mapping for megatron parameter 'decoder.layers.0.mlp.router.weight'"):
        hf_sources("decoder.layers.0.mlp.router.weight")


# ------------------------------------------------------------------------------------------ HF -> megatron-core
@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_mcore_logits_and_tp_shards(case, hf_models, groups, tmp_path):
    hf_dir, hf = hf_models[case]
    cfg = model_config_from_hf(hf_dir, base=BASE)
    assert cfg.vocab_size == V and cfg.hf_path == str(hf_dir) and cfg.seq_length == 64
    model = _megatron(cfg, groups)
    stats = load_hf_into_model(model, groups, hf_dir, cfg)
    assert stats["tensors"] == len(list(model.parameters()))
    # the RL job skips the random initialisation of a model it loads next: the loaded weights are the same
    blank = build_gpt(cfg, groups, seed=99, initialize=False)
    assert all(not p.any() for p in blank.parameters())
    load_hf_into_model(blank, groups, hf_dir, cfg)
    loaded = dict(model.named_parameters())
    assert all(torch.equal(p, loaded[n]) for n, p in blank.named_parameters())

    tokens = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=tokens).logits.detach()
    out = _logits(model, tokens)
    assert out.shape == (2, 19, 80) and ref.shape == (2, 19, V)
    assert (out[..., V:] == PADDED_LOGIT).all()  # padded vocabulary columns are masked, never sampled
    head = model.output_layer.weight if cfg.untie_embeddings_and_output_weights else model.embedding.word_embeddings.weight
    assert torch.equal(head[V:], torch.zeros_like(head[V:]))  # zero-padded vocabulary rows
    scale, err = ref.abs().max().item(), (out[..., :V] - ref).abs().max().item()
    assert scale > 0.5
    assert err <= REL_TOL * scale, f"{case}: max |Δlogit| {err:.3g} > {REL_TOL} × {scale:.3g}"
    print(f"{case}: max|Δlogit| / max|logit| = {err / scale:.2e}")

    # the TP=1 rank file is exactly what the model holds after load_hf_into_model
    meta = convert_hf_to_mcore(hf_dir, tmp_path / "tp1")
    assert meta["tp"] == meta["pp"] == 1 and meta["source"]["architecture"] == type(hf).__name__
    assert meta["model_config"]["vocab_size"] == V and meta["padded_vocab_size"] == 80
    tp1 = load_file(str(tmp_path / "tp1" / "model_tp0_pp0.safetensors"))
    params = dict(model.named_parameters())
    assert set(tp1) == set(params)
    assert all(torch.equal(tp1[k], params[k].detach()) for k in tp1)
    fresh = _megatron(cfg, groups)
    load_mcore_into_model(fresh, groups, tmp_path / "tp1", cfg)
    assert torch.equal(_logits(fresh, tokens), out)

    if cfg.num_query_groups == 1:  # one KV head cannot be split over two TP ranks
        with pytest.raises(ValueError, match=r"model.num_query_groups=1 is not divisible by tp=2"):
            convert_hf_to_mcore(hf_dir, tmp_path / "tp2", tp=2)
        return
    convert_hf_to_mcore(hf_dir, tmp_path / "tp2", tp=2)
    for t in range(2):
        shard_file = load_file(str(tmp_path / "tp2" / f"model_tp{t}_pp0.safetensors"))
        assert set(shard_file) == set(tp1)
        for name, full in tp1.items():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # padded to 96 at TP=2
                full = torch.cat([full[:V], full.new_zeros(96 - V, full.shape[1])])
            assert torch.equal(shard_file[name], shard_full(full, name, params[name], t, 2)), (t, name)


# ------------------------------------------------------------------------------------------ round trips
def _assert_same_checkpoint(a: Path, b: Path, *, same_files: bool):
    sa, sb = _hf_state(a), _hf_state(b)
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    index_b = b / "model.safetensors.index.json"
    if index_b.exists():
        idx = json.loads(index_b.read_text())
        files = set(idx["weight_map"].values())
        assert files == {p.name for p in b.glob("*.safetensors")}
        for f in files:  # each shard holds exactly the tensors the index assigns to it
            assert set(load_file(str(b / f))) == {k for k, v in idx["weight_map"].items() if v == f}
        assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sb.values())
        if same_files:
            ref = json.loads((a / "model.safetensors.index.json").read_text())
            assert idx["weight_map"] == ref["weight_map"]
            assert idx["metadata"]["total_size"] == ref["metadata"]["total_size"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).exists() == (b / name).exists(), name
        if (a / name).exists():
            assert (b / name).read_bytes() == (a / name).read_bytes(), name


@pytest.mark.parametrize("case", ["llama_gqa_untied", "qwen2_bias_tied", "qwen3_norm_untied"])
def test_round_trip_bitwise(case, hf_models, tmp_path):
    hf_dir, _ = hf_models[case]
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2, pp=2)
    names = sorted(p.name for p in (tmp_path / "mc").glob("*.safetensors"))
    assert names == sorted(f"model_tp{t}_pp{p}.safetensors" for p in range(2) for t in range(2))
    last = load_file(str(tmp_path / "mc" / "model_tp1_pp1.safetensors"))
    assert "decoder.layers.0.mlp.linear_fc1.weight" in last and "decoder.final_layernorm.weight" in last
    assert "output_layer.weight" in last  # tied or not, the last stage holds the head
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "with_template", hf_template=hf_dir)
    _assert_same_checkpoint(hf_dir, tmp_path / "with_template", same_files=True)
    # without a template: config and tokenizer from mcore/hf, shards planned by size
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "planned", max_shard_size="30KB")
    assert len(list((tmp_path / "planned").glob("model-*-of-*.safetensors"))) > 1
    _assert_same_checkpoint(hf_dir, tmp_path / "planned", same_files=False)


def test_converted_hf_loads_in_transformers_and_trainer_checkpoint_exports(hf_models, groups, tmp_path):
    from megatron_logra.checkpoint import save_checkpoint

    hf_dir, hf = hf_models["qwen3_norm_untied"]
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2)
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "single")  # no template: 5GB shards -> one file
    assert (tmp_path / "single" / "model.safetensors").exists()
    assert not (tmp_path / "single" / "model.safetensors.index.json").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "single", dtype=torch.float32).eval()
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    assert torch.equal(back(input_ids=tokens).logits, hf(input_ids=tokens).logits)

    # a trainer checkpoint (megatron_logra.checkpoint) exports to HF too
    cfg = model_config_from_hf(hf_dir, base=BASE)
    model = _megatron(cfg, groups)
    load_hf_into_model(model, groups, hf_dir, cfg)
    step = save_checkpoint(tmp_path / "run", 3, model, None, groups,
                           config={"model": dataclasses.asdict(cfg)})
    convert_mcore_to_hf(step, tmp_path / "from_trainer", hf_template=hf_dir)
    _assert_same_checkpoint(hf_dir, tmp_path / "from_trainer", same_files=True)


def test_bf16_round_trip_keeps_dtype(hf_models, tmp_path):
    """bf16 checkpoints stay bf16 bitwise through mcore (TP2 x PP2) and back; meta.json records the dtype."""
    _, hf = hf_models["qwen3_norm_untied"]
    src = tmp_path / "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()
    meta = convert_hf_to_mcore(src, tmp_path / "mc", tp=2, pp=2)
    assert meta["model_config"]["params_dtype"] == "bfloat16" and meta["source"]["dtypes"] == ["bfloat16"]
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "mc" / "model_tp1_pp1.safetensors")).values())
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", hf_template=src)
    _assert_same_checkpoint(src, tmp_path / "back", same_files=True)


def test_mcore_files_must_match_meta(hf_models, tmp_path):
    hf_dir = hf_models["llama_gqa_untied"][0]
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2)
    good = (tmp_path / "mc" / "meta.json").read_text()
    meta = json.loads(good)
    meta["model_config"]["ffn_hidden_size"] = 48  # the files hold ffn 96
    (tmp_path / "mc" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"model_tp0_pp0.safetensors: tensor 'decoder.layers.0.mlp.linear_fc1.weight' "
                                         r"has shape \[96, 64\], expected \[48, 64\] at tp=2"):
        convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")
    (tmp_path / "mc" / "meta.json").write_text(good)
    (tmp_path / "mc" / "model_tp1_pp0.safetensors").unlink()
    with pytest.raises(ValueError, match=r"rank file model_tp1_pp0.safetensors is missing"):
        convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")


# ------------------------------------------------------------------------------------------ rejections
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    raw = json.loads((d / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))


def _rewrite_tensor(d: Path, name: str, tensor) -> None:
    """Replace (``tensor``) or drop (``None``) one tensor of a checkpoint, keeping the index consistent."""
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    fname = index["weight_map"][name] if index else "model.safetensors"
    state = load_file(str(d / fname))
    if tensor is None:
        del state[name]
        if index:
            del index["weight_map"][name]
            if not state:
                (d / fname).unlink()
    else:
        state[name] = tensor
    if state:
        save_file(state, str(d / fname), metadata={"format": "pt"})
    if index:
        index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("change, match", [
    (dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox"), r"architectures=\['GPTNeoXForCausalLM'\]"),
    # the family is named before any of its fields (Gemma 3's sliding window would mislead)
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=512),
     r"architectures=\['Gemma3ForCausalLM'\] is not supported"),
    # Llama 3 scaling only with the constants megatron-core builds it with
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}),
     r"rope_parameters.low_freq_factor=None is not supported: .*low_freq_factor=1.0"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}),
     r"rope_parameters.original_max_position_embeddings=4096"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": -2.0, "rope_theta": 5e5, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     r"rope_parameters.factor=-2.0 must be a positive number"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}),
     r"rope_parameters.rope_type='dynamic'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), r"rope_scaling.rope_type='yarn'"),
    # Qwen2: only layers >= max_window_layers slide (the saved default 28 would leave both layers full), and
    # only when layer_types is absent (the saved list names both layers full_attention, which transformers keeps)
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1, drop=("layer_types",)),
     r"use_sliding_window=True"),
    (dict(layer_types=["sliding_attention", "full_attention"]), r"layer_types contains \['sliding_attention'\]"),
    (dict(num_experts=8), r"num_experts=8 \(mixture of experts\)"),
    (dict(head_dim=0), r"head_dim=0"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    (dict(quantization_config={"quant_method": "gptq"}), r"quantization_config is set"),
    # a window the model's context (max_position_embeddings=64 here) reaches past
    (dict(sliding_window=32, source="mistral_untied"), r"sliding_window=32 is not supported"),
    # Mistral: a missing sliding_window is MistralConfig's 4096, and use_sliding_window is no switch there
    (dict(drop=("sliding_window",), max_position_embeddings=8192, source="mistral_untied"),
     r"sliding_window=4096 \(the key is missing"),
    (dict(use_sliding_window=False, sliding_window=32, source="mistral_untied"),
     r"sliding_window=32 is not supported .* whatever use_sliding_window says"),
])
def test_rejects_unsupported_config(change, match, hf_models, tmp_path):
    change = dict(change)
    d = _copy(hf_models[change.pop("source", "qwen2_bias_tied")][0], tmp_path / "hf")
    drop = change.pop("drop", ())
    _edit_config(d, **change)
    if drop:
        raw = json.loads((d / "config.json").read_text())
        for key in drop:
            del raw[key]
        (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        convert_hf_to_mcore(d, tmp_path / "out")
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(d)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_rejects_bad_tensors_and_files(hf_models, tmp_path):
    src = hf_models["llama_gqa_untied"][0]  # sharded
    out = tmp_path / "out"

    d = _copy(src, tmp_path / "missing")
    _rewrite_tensor(d, "model.layers.1.mlp.up_proj.weight", None)
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        convert_hf_to_mcore(d, out)

    d = _copy(src, tmp_path / "shape")
    _rewrite_tensor(d, "model.layers.0.self_attn.k_proj.weight", torch.zeros(15, 64))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' \(in model-\d+-of-\d+"
                                         r"\.safetensors\) has shape \[15, 64\], config.json implies \[16, 64\]"):
        convert_hf_to_mcore(d, out)

    d = _copy(src, tmp_path / "unknown")
    _rewrite_tensor(d, "model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64))
    state = load_file(str(d / "model-00001-of-00011.safetensors"))
    save_file(dict(state, **{"model.layers.0.mlp.extra.weight": torch.zeros(2)}), str(d / "model-00001-of-00011.safetensors"))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00011.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"unknown tensors \['model.layers.0.mlp.extra.weight \(in model-00001"):
        convert_hf_to_mcore(d, out)

    d = _copy(src, tmp_path / "truncated")
    shard = d / "model-00003-of-00011.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"model-00003-of-00011.safetensors: truncated safetensors file"):
        convert_hf_to_mcore(d, out)

    d = _copy(src, tmp_path / "lost_shard")
    (d / "model-00002-of-00011.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard model-00002-of-00011.safetensors \(holding '.*'\) does not exist"):
        convert_hf_to_mcore(d, out)

    d = _copy(hf_models["qwen2_bias_tied"][0], tmp_path / "single_truncated")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5])
    with pytest.raises(ValueError, match=r"model.safetensors: truncated safetensors file"):
        convert_hf_to_mcore(d, out)
    assert not out.exists()


def test_rejects_bad_mcore_and_outputs(hf_models, tmp_path):
    hf_dir = hf_models["qwen2_bias_tied"][0]
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2)
    with pytest.raises(ValueError, match=r"is not empty \(pass --force"):
        convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2)
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", tp=2, force=True)  # replaces a previous conversion
    (tmp_path / "not_a_ckpt").mkdir()
    (tmp_path / "not_a_ckpt" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="does not look like a checkpoint"):
        convert_hf_to_mcore(hf_dir, tmp_path / "not_a_ckpt", force=True)
    assert (tmp_path / "not_a_ckpt" / "notes.txt").exists()

    bad = _copy(tmp_path / "mc", tmp_path / "corrupt")
    f = bad / "model_tp1_pp0.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model_tp1_pp0.safetensors: sha256 .* does not match meta.json"):
        convert_mcore_to_hf(bad, tmp_path / "hf_out")

    other = _copy(hf_models["qwen3_norm_untied"][0], tmp_path / "other")
    with pytest.raises(ValueError, match=r"model.qk_layernorm=False but .* has True"):
        convert_mcore_to_hf(tmp_path / "mc", tmp_path / "hf_out", hf_template=other)
    with pytest.raises(ValueError, match=r"model.hidden_size=32 but .* has 64"):
        load_hf_into_model(torch.nn.Linear(1, 1), None, hf_dir,
                           dataclasses.replace(model_config_from_hf(hf_dir), hidden_size=32))
    with pytest.raises(ValueError, match=r"model.hf_path='.*nowhere' is not a directory"):
        load_hf_into_model(torch.nn.Linear(1, 1), None, tmp_path / "nowhere", BASE)
    with pytest.raises(ValueError, match=r"model.hf_path='.*nowhere' is not a directory"):
        model_config_from_hf(tmp_path / "nowhere", base=BASE)
    with pytest.raises(ValueError, match=r"model.hf_path='.*mc': .*no config.json"):
        model_config_from_hf(tmp_path / "mc", base=BASE)


# ------------------------------------------------------------------------------------------ CLI and memory
def _run(*args, timeout=120, **env):
    """``python ARGS...`` in a process of its own (forked warm where it can be), from the checkout."""
    return forked.python(list(args), timeout=timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_cli_subprocess(hf_models, tmp_path):
    hf_dir = hf_models["llama_gqa_untied"][0]
    proc = _run("-m", "megatron_logra.cli", "convert", "hf-to-mcore", "--hf", str(hf_dir), "--out",
                str(tmp_path / "mc"), "--tp", "2", "--pp", "2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tp"] == 2 and (tmp_path / "mc" / "model_tp1_pp1.safetensors").exists()
    proc = _run("tools/convert_checkpoint.py", "mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out",
                str(tmp_path / "hf"), "--hf-template", str(hf_dir))
    assert proc.returncode == 0, proc.stderr
    _assert_same_checkpoint(hf_dir, tmp_path / "hf", same_files=True)
    proc = _run("-m", "megatron_logra.cli", "convert", "hf-to-mcore", "--hf", str(hf_dir), "--out",
                str(tmp_path / "mc3"), "--tp", "3")
    assert proc.returncode == 2 and "model.num_attention_heads=8 is not divisible by tp=3" in proc.stderr


def _llama_shards(src: Path, h: int, f: int, layers: int, vocab: int, num_files: int) -> tuple[dict, dict, int]:
    """An fp32 Llama checkpoint of constant-filled tensors in ``num_files`` shards whose boundaries cut through
    layers; returns (shapes, fill values, total bytes)."""
    raw = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=h, intermediate_size=f,
               num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab,
               tie_word_embeddings=False, dtype="float32", max_position_embeddings=128)
    src.mkdir()
    (src / "config.json").write_text(json.dumps(raw))
    kv = 2 * h // 8
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    names = list(shapes)
    weight_map, fill, total = {}, {}, 0
    for k in range(num_files):
        chunk = names[k * len(names) // num_files:(k + 1) * len(names) // num_files]
        fname = f"model-{k + 1:05d}-of-{num_files:05d}.safetensors"
        fill.update({n: float(j % 7) for j, n in enumerate(chunk)})
        state = {n: torch.full(shapes[n], fill[n]) for n in chunk}
        total += sum(t.numel() * 4 for t in state.values())
        save_file(state, str(src / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
        del state
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return shapes, fill, total


def _live_tensor_growth(fn) -> tuple[int, int]:
    """(peak, final) bytes of live tensor storages above those alive before ``fn()``: every storage a torch
    op returns is counted until torch frees it (``LiveTensorTracker``), so the figure is exact and the same
    on every machine, unlike peak RSS (allocator caching, page accounting; see benchmarks/convert_memory.py)."""
    import gc

    from megatron_logra.memory.measure import LiveTensorTracker

    gc.collect()
    with warnings.catch_warnings():  # the tracker's scan of live objects touches deprecated torch aliases
        warnings.simplefilter("ignore", FutureWarning)
        tracker = LiveTensorTracker().__enter__()
    try:
        fn()
        gc.collect()
    finally:
        tracker.__exit__(None, None, None)
    return tracker.peak - tracker.start_bytes, tracker.current - tracker.start_bytes


def test_conversion_streams_one_parameter_at_a_time(tmp_path):
    """Both directions hold at most one full megatron parameter plus one part / shard of it (<= 2x the
    largest parameter), whatever the checkpoint or shard size, and keep no tensor once they return."""
    h, f, layers, vocab = 128, 384, 8, 1000
    shapes, fill, total = _llama_shards(tmp_path / "big", h, f, layers, vocab, num_files=4)
    cfg = model_config_from_hf(tmp_path / "big")
    largest = 4 * max(cfg.padded_vocab_size(2) * h, 2 * f * h)  # the padded embedding / fused fc1, bytes
    assert total > 10 * largest  # loading a shard file or the checkpoint whole would break the bound
    peak, kept = _live_tensor_growth(lambda: convert_hf_to_mcore(tmp_path / "big", tmp_path / "mc", tp=2, pp=2))
    # the lower bound shows the tracker sees the converter's tensors: the largest one is built in full
    assert largest <= peak <= 2 * largest and kept == 0, (peak, kept, largest)
    peak, kept = _live_tensor_growth(lambda: convert_mcore_to_hf(tmp_path / "mc", tmp_path / "hf",
                                                                 max_shard_size="1MB"))
    assert largest <= peak <= 2 * largest and kept == 0, (peak, kept, largest)
    back = _hf_state(tmp_path / "hf")
    assert set(back) == set(shapes)
    assert all(torch.equal(t, torch.full(shapes[n], fill[n])) for n, t in back.items())


@pytest.mark.parametrize("case", ["llama_gqa_untied", "qwen2_bias_tied", "qwen3_mqa_tied"])
def test_row_split_shards_read_only_their_rows(hf_models, case):
    """``build_shard`` (what each TP rank loads) equals the shard of the whole fused tensor
    (``build_full`` then ``shard``) for every parameter at TP 1, 2 and 4, and for row-split
    parameters reads only the bytes of that rank's rows."""
    from megatron_logra.convert.hf_checkpoint import HFCheckpoint
    from megatron_logra.convert.combine import build_full, build_shard
    from megatron_logra.convert.tensor_plan import shard

    hf_dir, _ = hf_models[case]
    cfg = model_config_from_hf(hf_dir, base=BASE)
    ckpt = HFCheckpoint(hf_dir)
    try:
        for tp in (1, 2, 4):
            if (cfg.num_query_groups or cfg.num_attention_heads) % tp:
                continue
            for e in megatron_plan(cfg, tp=tp, pp=1):
                dtype = ckpt.info(e.sources[0]).dtype
                whole = build_full(e, ckpt.read, cfg, dtype)
                for rank in range(tp):
                    read = []

                    def counting(name, out=None, rows=None):
                        t = ckpt.read(name, out=out, rows=rows)
                        read.append(t.numel() * t.element_size())
                        return t

                    got = build_shard(e, counting, cfg, dtype, rank, tp, lambda n: ckpt.info(n).shape[0])
                    want = shard(whole, e.partition, rank, tp)
                    assert torch.equal(got, want), f"{case} tp={tp} rank={rank}: {e.name} differs"
                    total = sum(ckpt.info(s).nbytes for s in e.sources)
                    if e.partition is not None and e.partition[0] == 0 and tp > 1:
                        held = want.numel() * want.element_size()  # this rank's rows (padding is not read)
                        assert sum(read) <= held < total, f"{e.name}: read {sum(read)} of {total} bytes at tp={tp}"
                    else:
                        assert sum(read) == total
    finally:
        ckpt.close()
