"""A trainer checkpoint (``RUN/checkpoints/step_XXXXXXXX``) exported with ``mcore-to-hf`` is servable.

A trainer checkpoint has no ``hf/`` folder. Without ``--hf-template``:

* the run's ``model.hf_path`` (read from the checkpoint's config), when it exists and describes the
  same architecture, is the template: its config.json (``max_position_embeddings``, token ids, ...)
  and generation_config.json are kept;
* otherwise config.json is generated, and must still be servable: ``architectures`` names the HF class
  (vLLM refuses a config without it), a top-level ``rope_theta`` equal to ``model.rotary_base``
  (transformers 4.x reads only that one and would silently use 10000), ``torch_dtype`` next to
  ``dtype``, bos / eos / pad ids of the run's tokenizer; a warning says it was generated.

The run's ``tokenizer/`` (saved by the job with ``save_pretrained``) is copied when present. The
exported checkpoint must load in transformers without missing or unexpected weights, and its logits
equal the trainer model's within ``test_convert.REL_TOL`` (fp32; the rotary base enters the logits).
"""

from __future__ import annotations

# test_convert resolves transformers' lazy model modules and torch's device-constructor cache before
# megatron_logra's CPU shim is imported (see there): keep this import first.
from test_convert import REL_TOL, TOKENIZER, _logits, _megatron  # noqa: I001

import dataclasses
import filecmp
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from megatron_logra.checkpoint import save_checkpoint
from megatron_logra.convert import convert_mcore_to_hf, load_hf_into_model, model_config_from_hf
from megatron_logra.data.tokenizer import load_tokenizer, save_tokenizer
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import megatron_to_hf

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

V = 70
DIMS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
            vocab_size=V, seq_length=64, rotary_base=1_000_000)
CASES = {  # model type -> (ModelConfig fields, the HF class)
    "llama_fp32_untied": (dict(params_dtype="float32", untie_embeddings_and_output_weights=True), "LlamaForCausalLM"),
    "qwen2_fp32_tied": (dict(add_qkv_bias=True, params_dtype="float32", untie_embeddings_and_output_weights=False),
                        "Qwen2ForCausalLM"),
    "qwen3_bf16_untied": (dict(qk_layernorm=True, params_dtype="bfloat16", untie_embeddings_and_output_weights=True),
                          "Qwen3ForCausalLM"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _trainer_checkpoint(run: Path, groups, cfg: ModelConfig, seed: int, model=None):
    """A trainer checkpoint under ``run`` of ``model`` (default: ``cfg``'s megatron model with random
    weights, O(1) logits; perturbed norms and biases catch misplaced 1-D tensors); returns (step, model)."""
    if model is None:
        model = _megatron(cfg, groups)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_((p.float() + 0.3 * noise) if p.dim() == 1 else 0.15 * noise)
    step = save_checkpoint(run, 5, model, None, groups, config={"model": dataclasses.asdict(cfg)})
    return step, model


def _run_tokenizer(run: Path):
    """``RUN/tokenizer`` as the RL job writes it (``save_pretrained`` of the loaded tokenizer)."""
    tok = load_tokenizer(TOKENIZER)
    tok.padding_side = "left"  # differs from the shipped files: shows which copy an export took
    save_tokenizer(tok, run / "tokenizer")
    return tok


def _load_hf(out: Path, dtype: torch.dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_config_is_servable(case, groups, tmp_path, caplog):
    fields, architecture = CASES[case]
    hf_path = str(tmp_path / "moved_away") if case.startswith("llama") else ""  # a model.hf_path no longer here
    cfg = ModelConfig(**DIMS, **fields, hf_path=hf_path)
    run = tmp_path / "run"
    step, model = _trainer_checkpoint(run, groups, cfg, seed=len(case))
    tok = _run_tokenizer(run)
    with caplog.at_level(logging.INFO, logger="megatron_logra.convert"):
        convert_mcore_to_hf(step, tmp_path / "hf")
    out = tmp_path / "hf"

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [architecture]
    assert raw["rope_theta"] == float(cfg.rotary_base) == 1e6  # top level: what transformers 4.x reads
    assert raw["torch_dtype"] == raw["dtype"] == cfg.params_dtype
    assert raw["vocab_size"] == V and raw["max_position_embeddings"] == cfg.seq_length
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) != (None, None, None)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("generated" in m and "max_position_embeddings" in m for m in warned), warned
    if hf_path:
        assert any(hf_path in m for m in warned), warned

    # the run's tokenizer files, unchanged, and they load
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(run / "tokenizer" / name, out / name, shallow=False), name
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).get_vocab() == tok.get_vocab()
    assert not (out / "generation_config.json").exists()

    hf_cfg = AutoConfig.from_pretrained(out)
    assert type(hf_cfg).__name__ == architecture.replace("ForCausalLM", "Config")
    assert hf_cfg.rope_parameters["rope_theta"] == 1e6
    exported = load_file(str(out / "model.safetensors"))
    reference = megatron_to_hf({n: p.detach() for n, p in model.named_parameters()}, cfg)
    if cfg.untie_embeddings_and_output_weights is False:
        reference.pop("lm_head.weight", None)
    assert set(exported) == set(reference)
    assert all(torch.equal(exported[n], reference[n][:V] if "embed" in n or "lm_head" in n else reference[n])
               for n in exported)

    # transformers loads it without missing weights and computes the trainer model's logits (fp32: a bf16
    # model's weights are compared through an fp32 twin, bf16 -> fp32 being exact)
    hf = _load_hf(out, torch.float32)
    state = hf.state_dict()
    assert all(torch.equal(state[n], t.float()) for n, t in exported.items())
    twin = _megatron(dataclasses.replace(cfg, params_dtype="float32"), groups)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(params[n].float())
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(4))
    ref = _logits(twin, tokens)[..., :V]
    with torch.no_grad():
        got = hf(input_ids=tokens).logits
    scale, err = ref.abs().max().item(), (got - ref).abs().max().item()
    assert scale > 0.5 and err <= REL_TOL * scale, f"max |Δlogit| {err:.3g} > {REL_TOL} × {scale:.3g}"


def _hf_template(root: Path) -> tuple[Path, object]:
    """An HF checkpoint to start a run from: long context, token ids, a generation config, a tokenizer."""
    config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        for _, p in model.named_parameters():
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    0.15 * torch.randn(p.shape, generator=gen))
    out = root / "base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 5], temperature=0.7, top_p=0.8, do_sample=True) \
        .save_pretrained(out)
    for f in TOKENIZER.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out, model


@pytest.mark.parametrize("run_tokenizer", [False, True], ids=["template_tokenizer", "run_tokenizer"])
def test_run_hf_path_is_the_default_template(run_tokenizer, groups, tmp_path, caplog):
    base, hf_model = _hf_template(tmp_path)
    cfg = model_config_from_hf(base, base=ModelConfig(seq_length=64, params_dtype="float32"))
    assert cfg.hf_path == str(base) and cfg.seq_length == 64
    run = tmp_path / "run"
    model = _megatron(cfg, groups)
    load_hf_into_model(model, groups, base, cfg)
    step, _ = _trainer_checkpoint(run, groups, cfg, seed=0, model=model)
    del model
    if run_tokenizer:
        _run_tokenizer(run)
        assert not filecmp.cmp(run / "tokenizer" / "tokenizer_config.json", base / "tokenizer_config.json",
                               shallow=False)
    with caplog.at_level(logging.INFO, logger="megatron_logra.convert"):
        convert_mcore_to_hf(step, tmp_path / "hf")
    out = tmp_path / "hf"

    assert (out / "config.json").read_text() == (base / "config.json").read_text()  # the original's config
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 4096
    assert filecmp.cmp(base / "generation_config.json", out / "generation_config.json", shallow=False)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("model.hf_path" in m and str(base) in m for m in infos), infos
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    tokenizer_src = run / "tokenizer" if run_tokenizer else base
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(tokenizer_src / name, out / name, shallow=False), name

    back = _load_hf(out, torch.float32)
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, hf_model(input_ids=tokens).logits)
    assert back.generation_config.eos_token_id == [2, 5]

    if run_tokenizer:  # an explicit template gives the config; the tokenizer is still the run's
        convert_mcore_to_hf(step, tmp_path / "explicit", hf_template=base)
        assert (tmp_path / "explicit" / "config.json").read_text() == (base / "config.json").read_text()
        for name in TOKENIZER_FILES:
            assert filecmp.cmp(run / "tokenizer" / name, tmp_path / "explicit" / name, shallow=False), name


def test_run_hf_path_of_another_architecture_is_not_used(groups, tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir()
    config = LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(other)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    cfg = ModelConfig(**DIMS, params_dtype="float32", hf_path=str(other))
    step, _ = _trainer_checkpoint(tmp_path / "run", groups, cfg, seed=1)
    with caplog.at_level(logging.INFO, logger="megatron_logra.convert"):
        convert_mcore_to_hf(step, tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["hidden_size"] == 64 and raw["architectures"] == ["LlamaForCausalLM"] and raw["rope_theta"] == 1e6
    assert not (tmp_path / "hf" / "generation_config.json").exists()
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "hidden_size" in warned and str(other) in warned and "generated" in warned


def test_copied_config_names_the_dtype_of_the_exported_tensors(groups, tmp_path, caplog):
    """A bf16 run started from an fp32 checkpoint: the template's config.json is kept but for its dtype fields,
    which name what was written (it said float32 over bf16 tensors)."""
    base, _ = _hf_template(tmp_path)
    template = json.loads((base / "config.json").read_text())
    keys = [k for k in ("torch_dtype", "dtype") if k in template]
    assert keys and all(template[k] == "float32" for k in keys)
    cfg = model_config_from_hf(base, base=ModelConfig(seq_length=64, params_dtype="bfloat16"))
    step, _ = _trainer_checkpoint(tmp_path / "run", groups, cfg, seed=4)
    for name, kwargs in (("run", {}), ("explicit", {"hf_template": base})):
        out = tmp_path / f"hf_{name}"
        with caplog.at_level(logging.INFO, logger="megatron_logra.convert"):
            convert_mcore_to_hf(step, out, **kwargs)
        tensors = load_file(str(out / "model.safetensors"))  # bf16 weights (the local layers keep norms in fp32)
        assert tensors["model.embed_tokens.weight"].dtype == tensors["lm_head.weight"].dtype == torch.bfloat16
        raw = json.loads((out / "config.json").read_text())
        assert all(raw[k] == "bfloat16" for k in keys), raw
        assert {k: v for k, v in raw.items() if k not in keys} == {k: v for k, v in template.items() if k not in keys}
    assert any("bfloat16" in r.getMessage() and "dtype" in r.getMessage() for r in caplog.records)
