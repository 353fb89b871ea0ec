"""CPU side of the TransformerEngine path: TE is never imported, config fields validate and name
themselves, ``auto`` falls back to the local spec, TE's fused-norm names map to local names, and
the GPU recipes and launch scripts are well formed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_logra.config import RECIPES, apply_overrides, load_recipe
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.layout import canonical_param_name
from megatron_logra.models.te import resolve_transformer_impl, te_installed, te_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback (no CUDA)")

GUARD = """
import sys
import megatron_logra, megatron_logra.config
import megatron_logra.sketch.capture, megatron_logra.sketch.fp8
from megatron_logra.models.gpt import ModelConfig, build_gpt
from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from megatron_logra.sketch.capture import install_sketches
groups = initialize_parallel(ParallelConfig())
model = build_gpt(ModelConfig(transformer_impl="auto"), groups)
install_sketches(model, rank=4, tp_group=groups.tp)
names = sorted(n for n in sys.modules if n.split(".")[0] == "transformer_engine")
kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
destroy_parallel()
print("TE_MODULES", names)
print("LINEARS", kinds)
"""


@cpu_only
def test_package_and_tiny_model_never_import_transformer_engine():
    out = subprocess.run([sys.executable, "-c", GUARD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TE_MODULES []" in out.stdout, out.stdout
    assert "ColumnParallelLinear" in out.stdout and "TELayerNorm" not in out.stdout


@cpu_only
def test_auto_resolves_to_local_and_explicit_te_is_a_clear_error():
    assert te_unavailable_reason() is not None
    assert resolve_transformer_impl("auto") == "local"
    assert resolve_transformer_impl("local") == "local"
    with pytest.raises(RuntimeError, match="transformer_impl"):
        resolve_transformer_impl("transformer_engine")


@pytest.mark.skipif(te_installed(), reason="transformer_engine must not be installed on CPU machines")
def test_requesting_te_without_te_names_the_field():
    with pytest.raises(ValueError, match=r"model\.transformer_impl='transformer_engine'.*not installed"):
        ModelConfig(transformer_impl="transformer_engine")


@pytest.mark.parametrize("kwargs,field", [
    (dict(transformer_impl="te"), "model.transformer_impl"),
    (dict(fp8="hybrid"), "model.fp8"),  # local spec: no FP8
    (dict(fp8="e5m2", transformer_impl="auto"), "model.fp8"),
    (dict(fp8="hybrid", transformer_impl="auto", fp8_recipe="nvfp4"), "model.fp8_recipe"),
    (dict(sequence_parallel=True), "model.sequence_parallel"),
])
def test_bad_gpu_fields_are_rejected_with_the_field_named(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig(**kwargs)


def test_overrides_parse_fp8_null_and_gpu_fields():
    cfg = apply_overrides(load_recipe("lm-tiny"), ["model.transformer_impl=auto", "model.fp8=hybrid",
                                                   "model.sequence_parallel=true", "model.fp8_recipe=tensorwise"])
    assert (cfg.model.transformer_impl, cfg.model.fp8, cfg.model.sequence_parallel) == ("auto", "hybrid", True)
    cfg = apply_overrides(cfg, ["model.fp8=null"])
    assert cfg.model.fp8 is None
    # Megatron-LM spellings
    cfg = apply_overrides(load_recipe("lm-tiny"), ["--transformer-impl", "auto", "--sequence-parallel",
                                                   "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"])
    assert (cfg.model.transformer_impl, cfg.model.sequence_parallel, cfg.model.fp8, cfg.model.fp8_recipe) == \
        ("auto", True, "e4m3", "tensorwise")


@cpu_only
def test_fp8_with_auto_on_cpu_fails_at_build_with_the_field_named():
    from megatron_logra.models.gpt import _transformer_config
    from megatron_logra.parallel import ParallelGroups

    cfg = ModelConfig(transformer_impl="auto", fp8="hybrid")
    with pytest.raises(RuntimeError, match=r"model\.fp8='hybrid'"):
        _transformer_config(cfg, ParallelGroups(), resolve_transformer_impl(cfg.transformer_impl))
    # shapes-only configs (the memory planner) ignore FP8 and sequence parallelism
    assert _transformer_config(cfg, ParallelGroups()).fp8 is None


def test_te_fused_norm_parameters_get_local_global_names():
    assert canonical_param_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_param_name("decoder.layers.0.mlp.linear_fc1.layer_norm_bias") == \
        "decoder.layers.0.pre_mlp_layernorm.bias"
    for same in ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_layernorm.weight",
                 "decoder.layers.1.input_layernorm.weight", "embedding.word_embeddings.weight"):
        assert canonical_param_name(same) == same


@pytest.mark.parametrize("name,tp", [("qwen2.5-1.5b", 1), ("qwen2.5-7b", 4), ("27b", 8)])
def test_large_recipes_validate_with_planner_layouts(name, tp):
    cfg = load_recipe(name).validate()
    assert name in RECIPES and RECIPES[name].__doc__
    assert cfg.job == "rl" and cfg.parallel.tp == tp and cfg.model.recompute == "full"
    assert cfg.optimizer.name == "logra" and cfg.optimizer.logra.rank == 128
    assert cfg.model.params_dtype == "bfloat16" and cfg.model.transformer_impl == "local"
    heads, groups = cfg.model.num_attention_heads, cfg.model.num_query_groups or cfg.model.num_attention_heads
    assert heads % tp == 0 and groups % tp == 0 and cfg.model.ffn_hidden_size % tp == 0
    assert cfg.optimizer.logra.rank <= cfg.model.hidden_size
    # the TE variant the examples document is a valid config too
    apply_overrides(cfg, ["model.transformer_impl=auto", "model.sequence_parallel=true", "model.fp8=hybrid"])
    assert cfg.kl.mode != "none" and cfg.kl.probe == "auto"  # TE targets take the finite-difference probe


@pytest.mark.parametrize("script", sorted((ROOT / "examples").glob("*.sh")), ids=lambda p: p.name)
def test_example_scripts_parse_and_name_existing_recipes(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    used = [r for r in RECIPES if f" {r} " in text or f" {r}\n" in text or f" {r} \\" in text]
    assert used, f"{script.name} runs no known recipe"


def test_hf_checkpoint_keeps_the_runs_gpu_fields(tmp_path):
    import json

    from megatron_logra.convert.hf_config import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    base = ModelConfig(transformer_impl="auto", fp8="hybrid", fp8_recipe="tensorwise", sequence_parallel=True)
    cfg = model_config_from_hf(tmp_path, base=base)
    assert (cfg.hidden_size, cfg.num_query_groups) == (64, 2)  # architecture from config.json
    assert (cfg.transformer_impl, cfg.fp8, cfg.fp8_recipe, cfg.sequence_parallel) == ("auto", "hybrid", "tensorwise", True)


def test_local_layernorm_weights_follow_a_16bit_params_dtype(groups):
    """megatron's local spec makes ``torch.nn.LayerNorm`` in fp32; CUDA's kernel needs them in the
    activations' dtype, so a bf16 model gets bf16 norms (RMSNorm keeps megatron's own choice)."""
    import warnings

    from megatron_logra.models.gpt import ModelConfig, build_gpt

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64,
                      seq_length=16, normalization="LayerNorm", qk_layernorm=True, params_dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(cfg, groups, seed=1)
    norms = [m for m in model.modules() if type(m) is torch.nn.LayerNorm]
    assert len(norms) == 2 * 4 + 1  # input, pre-MLP, q and k norms per layer; the final norm
    assert all(p.dtype == torch.bfloat16 for m in norms for p in m.parameters())
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        logits = model(tokens, torch.arange(16)[None].expand(2, -1), None)
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits.float()).all())
