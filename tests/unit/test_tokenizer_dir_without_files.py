"""``--model.hf_path DIR`` takes the tokenizer from the checkpoint directory. A directory without tokenizer
files (a model saved with ``save_pretrained`` but not its tokenizer) is refused naming the directory and what
it should hold: transformers >= 5 otherwise builds a tokenizer with an empty vocabulary from the bare
``config.json``, and the RL job then stopped with a misleading "the prompt ... tokenises to nothing"."""

from __future__ import annotations

import json

import pytest

from megatron_logra.data.tokenizer import build_char_tokenizer, load_tokenizer

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_a_checkpoint_directory_without_tokenizer_files_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds no tokenizer files .*config\.json.*tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_a_directory_with_a_saved_tokenizer_still_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    build_char_tokenizer(["1 + 2 = 3"]).save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert tok("1 + 2", add_special_tokens=False)["input_ids"]
