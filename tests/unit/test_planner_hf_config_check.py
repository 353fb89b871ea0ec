"""``megatron-logra memory --model config.json`` refuses the configs ``train --model.hf_path`` refuses, with the
trainer's own message (one loader: ``convert.hf_config.model_config_from_hf_dict_strict``)."""

from __future__ import annotations

import json

import pytest

from megatron_logra.convert.hf_config import model_config_from_hf
from megatron_logra.memory.cli import main, resolve_planned_model

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000,
         "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "hidden_act": "silu", "max_position_embeddings": 8192}
REFUSED = {
    # Mistral v0.1: a 4096-token sliding window on every layer
    "mistral-v0.1": ({**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                      "sliding_window": 4096}, "sliding_window"),
    "qwen2-sliding-window": ({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                              "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2},
                             "use_sliding_window"),
    "llama-3.1-rope-scaling": ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    "mixture-of-experts": ({**LLAMA, "num_experts": 8}, "num_experts"),
}


def _write(tmp_path, raw) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_planner_refuses_what_the_trainer_refuses(tmp_path, capsys, name):
    raw, field = REFUSED[name]
    path = _write(tmp_path, raw)
    with pytest.raises(ValueError) as trainer:
        model_config_from_hf(tmp_path)
    assert field in str(trainer.value)
    with pytest.raises(SystemExit) as exc:  # planned at the context the trainer read (max_position_embeddings)
        main(["--model", path, "--seq-len", "8192", "--gpu-memory", "80GiB", "--markdown"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(trainer.value).split(": ", 1)[1] in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["mistral-v0.1", "qwen2-sliding-window"])
def test_a_window_the_planned_sequences_stay_within_is_planned(tmp_path, capsys, name):
    """As the trainer accepts a run whose model.seq_length does not exceed the sliding window, the planner
    plans one at --seq-len 4096 and refuses one at 4097."""
    path = _write(tmp_path, REFUSED[name][0])
    assert main(["--model", path, "--seq-len", "4096", "--gpu-memory", "80GiB", "--markdown"]) == 0
    assert "verdict" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--model", path, "--seq-len", "4097", "--gpu-memory", "80GiB", "--markdown"])
    assert exc.value.code == 2 and "model.seq_length=4097" in capsys.readouterr().err


def test_a_config_the_trainer_accepts_is_planned_with_the_trainers_fields(tmp_path, capsys):
    path = _write(tmp_path, LLAMA)
    model = resolve_planned_model(path, seq_length=2048)
    trainer = model_config_from_hf(tmp_path)
    for field in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size", "rotary_base", "params_dtype", "untie_embeddings_and_output_weights", "kv_channels"):
        assert getattr(model, field) == getattr(trainer, field), field
    assert model.seq_length == 2048
    assert resolve_planned_model(str(tmp_path), seq_length=2048) == model  # the directory holding config.json
    assert main(["--model", path, "--seq-len", "2048", "--gpu-memory", "80GiB", "--markdown"]) == 0
    assert "verdict" in capsys.readouterr().out
