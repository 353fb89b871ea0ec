"""Supervised warm start: teach the policy the answer format on task demonstrations.

A tiny model from scratch cannot do RL (it never samples a correct answer). The warm start
trains it with dense AdamW on ``prompt -> reference answer + EOS`` for a few hundred steps,
deliberately short of mastery so RL has room to improve. Results are cached by a hash of
everything that determines them, so repeated runs skip it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from megatron_logra.optim import DenseAdamW, NativeConfig
from megatron_logra.parallel import ParallelGroups
from megatron_logra.rl.batching import pack_sequences, split_microbatches
from megatron_logra.train.step import forward_backward

logger = logging.getLogger(__name__)

__all__ = ["run_sft", "warm_start_key", "load_weights", "save_weights"]


def warm_start_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_weights(model: nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
               if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}, str(tmp))
    tmp.replace(path)


def load_weights(model: nn.Module, path: Path) -> None:
    if not Path(path).exists():
        raise FileNotFoundError(f"warm-start weights {path} do not exist")
    state = load_file(str(path))
    own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{path} lacks parameters {missing[:4]} (was it saved for another model config or layout?)")
    with torch.no_grad():
        for k, v in own.items():
            if state[k].shape != v.shape:
                raise ValueError(f"{path}: {k} has shape {tuple(state[k].shape)}, the model expects {tuple(v.shape)}")
            v.copy_(state[k])


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
    log: Optional[Callable[[int, float], None]] = None,
) -> float:
    """Train ``model`` on demonstrations ``demos(index) -> (prompt_ids, answer_ids)``; returns the last loss.

    Each DP rank takes its share of every global batch (indices are global, so any layout
    trains on the same data).
    """
    opt = DenseAdamW(model, NativeConfig(lr=lr, weight_decay=0.0), groups, clip_grad=1.0)
    per_rank = max(1, batch_size // groups.dp_size)
    loss = float("nan")
    for step in range(steps):
        base = step * batch_size + groups.dp_rank * per_rank
        pairs = [demos(base + i) for i in range(per_rank)]
        batch = pack_sequences(
            [p for p, _ in pairs], [a for _, a in pairs],
            rollout_logprobs=[[0.0] * len(a) for _, a in pairs], advantages=[0.0] * len(pairs),
            finished=[True] * len(pairs), pad_id=pad_id, max_length=max_length,
        )
        opt.zero_grad()
        result = forward_backward(model, split_microbatches(batch, micro_batch_size), groups)
        opt.step(num_tokens=result.num_tokens)
        loss = result.loss
        if log is not None:
            log(step + 1, loss)
    opt.native.remove_hooks()
    return loss
