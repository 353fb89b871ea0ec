"""A small checkpoint and damage its sizes cannot see, for the checkpoint-integrity tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from megatron_logra.checkpoint.dcp_metadata import _byte_items, read_dcp_metadata


def save_tiny_checkpoint(run_dir: Path):
    """Initialise a gloo world from torchrun's environment, build a 2-layer GPT and save it (weights only) as
    step 1 of ``run_dir``; returns ``(groups, model config, model, checkpoint dir, {file: bytes} from meta.json)``."""
    from megatron_logra.checkpoint import save_checkpoint
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, initialize_parallel

    groups = initialize_parallel(ParallelConfig(backend="gloo"))
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=64,
                      seq_length=16)
    model = build_gpt(cfg, groups, seed=3)
    ckpt = save_checkpoint(run_dir, 1, model, None, groups)
    sizes = {rel: e["bytes"] for rel, e in json.loads((ckpt / "meta.json").read_text())["files"].items()}
    return groups, cfg, model, ckpt, sizes


def flip_inside_a_byte_object(ckpt: Path, *, refusal_contains: str = "") -> tuple[str, str]:
    """Flip one byte of the first byte object of ``ckpt/dist`` (a layer's ``_extra_state``; the file keeps
    its size) such that ``torch.load(weights_only=True)`` refuses the object, with a message containing
    ``refusal_contains``; returns ``(file relative to ckpt, object key)``."""
    dist_dir = ckpt / "dist"
    rel, entries = sorted(_byte_items(dist_dir, read_dcp_metadata(dist_dir)).items())[0]
    offset, length, key = entries[0]
    data = bytearray((dist_dir / rel).read_bytes())
    for i in range(offset, offset + length):
        data[i] ^= 0xFF
        try:
            torch.load(io.BytesIO(bytes(data[offset:offset + length])), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - the flip wanted
            if refusal_contains in str(exc):
                (dist_dir / rel).write_bytes(bytes(data))
                return f"dist/{rel}", key
        data[i] ^= 0xFF
    raise AssertionError(f"no single flipped byte of {key} makes torch.load refuse it")
