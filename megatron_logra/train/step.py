"""Forward/backward of a GPT over micro-batches through megatron-core's pipeline schedules.

The loss is the *sum* of per-token losses over the masked tokens (megatron's
``calculate_per_token_loss`` mode); the optimizer divides by the global token count.
Works for PP = 1 (no pipelining) and PP > 1 (1F1B) alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence, Union

import torch
from torch import nn

from megatron_logra.parallel import ParallelGroups, all_reduce_sum

__all__ = ["Batch", "StepResult", "forward_backward"]


@dataclass
class Batch:
    """One micro-batch: ``[b, s]`` tensors."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


@dataclass
class StepResult:
    loss_sum: float
    """Sum of masked per-token losses over all micro-batches and DP ranks (0 off the last stage)."""
    num_tokens: int
    """This rank's masked tokens (the optimizer sums it over DP)."""
    global_tokens: int
    """Masked tokens over all DP ranks."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.global_tokens, 1)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm": report}


def _forward_step(data_iterator: Iterator[Batch], model: nn.Module):
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
    return output, partial(_loss_func, batch.loss_mask)


def forward_backward(
    model: Union[nn.Module, Sequence[nn.Module]],
    microbatches: Sequence[Batch],
    groups: ParallelGroups,
    *,
    forward_only: bool = False,
) -> StepResult:
    """Run every micro-batch forward (and backward unless ``forward_only``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        raise ValueError("forward_backward needs at least one micro-batch")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    mb, seq = microbatches[0].tokens.shape
    fb = get_forward_backward_func()
    outputs = fb(
        forward_step_func=_forward_step,
        data_iterator=iter(microbatches),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=mb,
        forward_only=forward_only,
    )
    num_tokens = int(sum(int(b.loss_mask.sum()) for b in microbatches))
    device = microbatches[0].tokens.device
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    if groups.pp_last:
        for out in outputs:
            stats += out["lm"].double()
    all_reduce_sum(stats, groups.dp)
    # only the last stage computed the loss: share it with the other stages
    if groups.pp_size > 1:
        all_reduce_sum(stats, groups.pp)
    global_tokens = torch.tensor([float(num_tokens)], dtype=torch.float64, device=device)
    all_reduce_sum(global_tokens, groups.dp)
    return StepResult(loss_sum=stats[0].item(), num_tokens=num_tokens, global_tokens=int(global_tokens.item()))
