"""Inputs and checks the converter tests share: a tiny Hugging Face Llama checkpoint on disk and a byte
snapshot of a directory (to assert that a refused or failed conversion left it as it was)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def tiny_llama_checkpoint(root: Path, *, name: str = "hf", seed: int = 0, tokenizer_stub: bool = False) -> Path:
    """``root/name``: a two-layer float32 ``LlamaForCausalLM`` (vocabulary 61, hidden 32, FFN 48, 4 heads, 2 KV
    heads, untied embeddings) initialised under ``torch.manual_seed(seed)`` and written by ``save_pretrained``
    as ``config.json``, ``generation_config.json`` and one ``model.safetensors``; ``tokenizer_stub``: also a
    ``tokenizer.json`` of ``{}`` (a checkpoint directory's usual file, never read)."""
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = root / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    if tokenizer_stub:
        (out / "tokenizer.json").write_text("{}")
    return out


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (path relative to ``root``) mapped to its bytes; directories are not listed."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
