"""Supervised warm start: teach the policy the answer format on task demonstrations.

A tiny model from scratch cannot do RL (it never samples a correct answer). The warm start
trains it with dense AdamW on ``prompt -> reference answer + EOS`` for a few hundred steps,
deliberately short of mastery so RL has room to improve. Results are cached by a hash of
everything that determines them, so repeated runs skip it.

Weight files (:func:`save_weights`) record a CRC-32 of their tensors, verified by
:func:`load_weights`; they are written under a temp name unique to the writer and renamed, so two
jobs writing the same cache entry never write into one file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from megatron_logra.checkpoint.files import save_safetensors
from megatron_logra.models.layout import global_param_names, shard_full
from megatron_logra.models.weights import OUTPUT_WEIGHT, WORD_EMBEDDINGS, weight_source_name
from megatron_logra.rl.weights import gather_full_model

from megatron_logra.optim import DenseAdamW, LossScaleConfig, NativeConfig
from megatron_logra.parallel import ParallelGroups
from megatron_logra.rl.batching import pack_sequences, split_microbatches
from megatron_logra.rl.config import share_per_rank
from megatron_logra.train.step import forward_backward

logger = logging.getLogger(__name__)

__all__ = ["run_sft", "warm_start_key", "load_weights", "save_weights", "tensors_crc32"]


def warm_start_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tensors_crc32(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 (8 hex digits) of the tensors' names, dtypes, shapes and bytes, in name order."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.view(torch.uint8).reshape(-1).numpy(), crc)
    return f"{crc:08x}"


def save_weights(model: nn.Module, groups: ParallelGroups, path: Path, meta: Optional[dict] = None) -> None:
    """Write the whole model (all TP shards and PP stages joined, global names, fp32) to one
    safetensors file with the CRC-32 of its tensors, from rank 0; every rank must call it."""
    full = gather_full_model(model, groups)
    if groups.is_rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        tensors = {k: v.cpu().contiguous() for k, v in full.items()}
        save_safetensors(tensors, tmp, metadata={"megatron_logra": json.dumps(meta or {}),
                                               "crc32": tensors_crc32(tensors)})
        tmp.replace(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def load_weights(model: nn.Module, groups: ParallelGroups, path: Path, vocab_size: Optional[int] = None) -> None:
    """Load a file written by :func:`save_weights` into this rank's shard, at any TP/PP layout. Its
    recorded CRC-32 is checked first (files without one load unchecked); a mismatch is a
    ``ValueError`` naming the file, with nothing loaded. The last stage's copy of tied word
    embeddings (PP > 1) takes the file's word embeddings (``models.weights.weight_source_name``): a
    file saved at PP = 1 has no other, and the two copies must be equal.

    The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by × TP``, so a file saved at another
    TP size may hold another number of word-embedding / output-layer rows. With ``vocab_size`` (the model's
    ``model.vocab_size``) such a file loads when it holds at least ``vocab_size`` rows: its first
    ``vocab_size`` rows are taken and the padding rows (never looked up, their logits masked) are zeros, as in
    a converted Hugging Face checkpoint; without it, or with fewer rows, the shapes must match."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"warm-start weights {path} do not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            recorded = (fh.metadata() or {}).get("crc32")
            state = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as exc:  # safetensors raises its own errors for a truncated or garbled file
        raise ValueError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                         f"if it is a warm-start cache, delete it and run again") from exc
    if recorded is not None and tensors_crc32(state) != recorded:
        raise ValueError(f"{path} is corrupt: its tensors do not match the CRC-32 {recorded} they were written with; "
                         f"if it is a warm-start cache, delete it and run again")
    names = {local: weight_source_name(model, g) for local, g in global_param_names(model).items()}
    missing = sorted(n for n in names.values() if n not in state)
    if missing:
        raise ValueError(f"{path} lacks parameters {missing[:4]} (saved for another model config?)")
    with torch.no_grad():
        for local, param in model.named_parameters():
            full = _repadded_vocab(state[names[local]], names[local], param, groups.tp_size, vocab_size)
            shard = shard_full(full, names[local], param, groups.tp_rank, groups.tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"{path}: {names[local]} has shape {tuple(full.shape)}, which does not fit "
                                 f"{tuple(param.shape)} at tp={groups.tp_size}")
            param.copy_(shard)


def _repadded_vocab(full: torch.Tensor, name: str, param: torch.Tensor, tp_size: int,
                    vocab_size: Optional[int]) -> torch.Tensor:
    """``full`` with its rows re-padded to ``param``'s padded vocabulary (``param``'s rows × ``tp_size``) when
    ``name`` is a vocabulary tensor saved at another padding and ``full`` holds at least ``vocab_size`` rows:
    the first ``vocab_size`` rows, then zeros. Anything else is returned as it is (its shape is checked by the
    caller)."""
    padded = param.shape[0] * tp_size
    if (vocab_size is None or name not in (WORD_EMBEDDINGS, OUTPUT_WEIGHT) or full.dim() != 2
            or full.shape[0] == padded or full.shape[0] < vocab_size or vocab_size > padded
            or full.shape[1] != param.shape[1]):
        return full
    out = torch.zeros(padded, full.shape[1], dtype=full.dtype)
    out[:vocab_size] = full[:vocab_size]
    return out


def run_sft(
    model: nn.Module,
    groups: ParallelGroups,
    demos: Callable[[int], tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    micro_batch_size: int,
    pad_id: int,
    max_length: int,
    multiple: int = 8,
    log: Optional[Callable[[int, float], None]] = None,
    final_lr_ratio: float = 1.0,
    max_tokens: int = 0,
) -> float:
    """Train ``model`` on demonstrations ``demos(index) -> (prompt_ids, answer_ids)``; returns the last loss.

    Each DP rank takes its share of every global batch of ``batch_size`` (``sft.batch_size``), which
    must divide evenly over the DP ranks (else ``ValueError``); indices are global, so any layout
    trains on the same data. The learning rate follows a cosine from ``lr`` to
    ``final_lr_ratio·lr`` at the last step. Micro-batches: ``micro_batch_size`` demonstrations, or with
    ``max_tokens`` (``rl.max_tokens_per_micro_batch``) the dynamic ones of ``rl.batching.plan_microbatches``.
    """
    per_rank = share_per_rank("sft.batch_size", batch_size, groups.dp_size, "demonstrations per warm-start step")
    opt = DenseAdamW(model, NativeConfig(lr=lr, weight_decay=0.0), groups, clip_grad=1.0,
                     loss_scale=LossScaleConfig())  # float16 models get a dynamic loss scale, as in the RL steps
    loss = float("nan")
    for step in range(steps):
        progress = step / max(1, steps - 1)
        opt.native.set_lr(lr * (final_lr_ratio + (1.0 - final_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))))
        base = step * batch_size + groups.dp_rank * per_rank
        pairs = [demos(base + i) for i in range(per_rank)]
        batch = pack_sequences(
            [p for p, _ in pairs], [a for _, a in pairs],
            rollout_logprobs=[[0.0] * len(a) for _, a in pairs], advantages=[0.0] * len(pairs),
            finished=[True] * len(pairs), pad_id=pad_id, max_length=max_length, multiple=multiple,
        )
        opt.zero_grad()
        result = forward_backward(model, split_microbatches(batch, micro_batch_size, max_tokens, multiple), groups,
                                  grad_scale=opt.loss_scale)
        opt.step(num_tokens=result.num_tokens)
        loss = result.loss
        if log is not None:
            log(step + 1, loss)
    opt.native.remove_hooks()
    return loss
