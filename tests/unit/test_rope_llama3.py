"""Llama 3 RoPE scaling (``model.rope_scaling_factor``) on both sides of the trainer/engine pair.

The trainer's megatron GPT (megatron-core's ``rope_scaling``) and the embedded engine's transformers model
(``rope_type: llama3`` from ``hf_config_from_model_config``) hold the same weights; their log-probs agree,
while the unscaled model's do not (so the comparison sees the scaling). A checkpoint's conversion is in
``test_convert.py`` (case ``llama3_rope_scaled``); SGLang's ``config.json`` carries the scaling as
``rope_scaling``; the field is validated.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

# Import before initialize_parallel: megatron_logra.cpu_shim's torch.cuda.Stream patch breaks late transformers imports.
from megatron_logra.rollout.embedded import EmbeddedEngine
from megatron_logra.models.gpt import ModelConfig, build_gpt
from megatron_logra.models.hf import megatron_to_hf
from megatron_logra.models.layout import gather_full_state
from megatron_logra.rollout.sglang_api import engine_hf_config

# head_dim 16 at base 5e5: wavelengths below 2048, between 2048 and 8192 and above 8192 (every branch)
CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=64, seq_length=64, init_std=0.1, rotary_base=500000, rope_scaling_factor=8.0)
pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")


def _logprobs(cfg: ModelConfig, state: dict, seq: list[int]) -> torch.Tensor:
    engine = EmbeddedEngine(cfg)
    engine.update_weights_full(state, version=1)
    return torch.tensor(engine.logprobs_of([seq], [1])[0])


def test_trainer_and_embedded_engine_agree_under_llama3_rope_scaling(groups):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(CFG, groups, seed=5).eval()
    seq = torch.randint(0, CFG.vocab_size, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([seq]), torch.arange(64)[None], None)[0, :, :CFG.vocab_size].float()
    ours = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    state = megatron_to_hf(gather_full_state(model, groups.tp), CFG)
    scaled = _logprobs(CFG, state, seq)
    unscaled = _logprobs(dataclasses.replace(CFG, rope_scaling_factor=None), state, seq)
    err, gap = (scaled - ours).abs().max().item(), (unscaled - ours).abs().max().item()
    assert err < 5e-5, err
    print(f"max |Δlogprob| scaled {err:.2e}, unscaled {gap:.2e}")
    assert gap > 100 * max(err, 1e-6), (err, gap)  # the scaling is seen: without it the engine is far off


def test_the_sglang_config_carries_the_scaling_as_rope_scaling():
    scaled = engine_hf_config(CFG)
    assert scaled["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert scaled["rope_theta"] == 500000.0
    assert engine_hf_config(dataclasses.replace(CFG, rope_scaling_factor=None))["rope_scaling"] is None


@pytest.mark.parametrize("kw, match", [
    (dict(rope_scaling_factor=0.0), "model.rope_scaling_factor=0.0 must be a finite number > 0"),
    (dict(rope_scaling_factor=float("nan")), "model.rope_scaling_factor=nan"),
    (dict(rope_scaling_factor=8.0, position_embedding_type="learned_absolute"), "scales RoPE"),
])
def test_rope_scaling_factor_is_validated_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_the_planner_reads_an_unsupported_llama3_config_with_a_warning(caplog):
    """The memory planner (``strict=False``) needs shapes only: scaling it cannot build is ignored, not refused."""
    from megatron_logra.models.presets import hf_rope_scaling_factor

    raw = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32768}}
    with caplog.at_level("WARNING"):
        assert hf_rope_scaling_factor(raw, "c.json", strict=False) is None
    assert "original_max_position_embeddings=32768" in caplog.text
    with pytest.raises(ValueError, match="c.json: rope_parameters.original_max_position_embeddings=32768"):
        hf_rope_scaling_factor(raw, "c.json")
    raw["rope_parameters"]["original_max_position_embeddings"] = 8192
    assert hf_rope_scaling_factor(raw, "c.json", strict=False) == hf_rope_scaling_factor(raw, "c.json") == 8.0


@pytest.mark.parametrize("flags, want", [
    (["--use-rope-scaling"], 8.0),  # Megatron-LM's default factor
    (["--use-rope-scaling", "--rope-scaling-factor", "32"], 32.0),
    (["--rope-scaling-factor", "32", "--use-rope-scaling"], 32.0),  # either order
    (["model.rope_scaling_factor=4", "--use-rope-scaling"], 4.0),
    ([], None),
])
def test_megatron_lm_rope_scaling_flags(flags, want):
    from megatron_logra.config import parse_args_to_config

    assert parse_args_to_config("lm-tiny", flags).model.rope_scaling_factor == want
