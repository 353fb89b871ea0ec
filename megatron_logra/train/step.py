"""Forward/backward of a GPT over micro-batches through megatron-core's pipeline schedules.

The loss is the *sum* of per-token losses over the masked tokens (megatron's
``calculate_per_token_loss`` mode); the optimizer divides by the global token count.
Works for PP = 1 (no pipelining) and PP > 1 (1F1B) alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.parallel import ParallelGroups, all_reduce_sum

__all__ = ["Batch", "StepResult", "forward_backward"]


@dataclass
class Batch:
    """One micro-batch: ``[b, s]`` tensors. ``labels[i]`` is the token after ``tokens[i]``;
    ``loss_mask`` selects the positions that count. RL batches also carry per-token
    advantages and log-probs (rollout, reference) aligned with ``labels``."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    extras: dict = field(default_factory=dict)

    def to(self, device: torch.device) -> "Batch":
        """This batch with every tensor (extras included) on ``device`` (no copy where it already is)."""
        if self.tokens.device == device:
            return self
        return Batch(self.tokens.to(device), self.labels.to(device), self.loss_mask.to(device),
                     self.position_ids.to(device),
                     {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()})


def model_device(model: Union[nn.Module, Sequence[nn.Module]]) -> torch.device:
    """Where the model's parameters live (the device micro-batches are moved to)."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    return next(chunk.parameters()).device


@dataclass
class StepResult:
    reports: dict = field(default_factory=dict)
    """Extra report tensors of a custom loss, summed over micro-batches and DP ranks."""
    loss_sum: float = 0.0
    """Sum of masked per-token losses over all micro-batches and DP ranks (0 off the last stage)."""
    num_tokens: int = 0
    """This rank's masked tokens (the optimizer sums it over DP)."""
    global_tokens: int = 0
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


LossFn = Callable[[Batch, torch.Tensor], tuple]
"""``loss_fn(batch, logits) -> (loss_sum, num_tokens (int tensor), {"lm": report tensor, ...})``
where ``logits`` are this TP rank's vocabulary shard ``[b, s, V/tp]``; ``report["lm"]`` is
``[loss_sum, tokens]`` and further entries are summed over micro-batches and DP ranks."""


def _lm_forward_step(data_iterator: Iterator[Batch], model: nn.Module):
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
    return output, partial(_loss_func, batch.loss_mask)


def _custom_forward_step(loss_fn: LossFn, data_iterator: Iterator[Batch], model: nn.Module):
    batch = next(data_iterator)
    logits = model(batch.tokens, batch.position_ids, None)
    return logits, partial(loss_fn, batch)


def _scale_loss(scale: float, loss: torch.Tensor) -> torch.Tensor:
    return loss * scale


def forward_backward(
    model: Union[nn.Module, Sequence[nn.Module]],
    microbatches: Sequence[Batch],
    groups: ParallelGroups,
    *,
    forward_only: bool = False,
    loss_fn: Optional[LossFn] = None,
    grad_scale: float = 1.0,
) -> StepResult:
    """Run every micro-batch forward (and backward unless ``forward_only``).

    Without ``loss_fn`` the loss is the masked next-token cross entropy (megatron's fused
    path); with it, ``loss_fn`` turns the logits into the loss (RL objectives). ``grad_scale``: backward
    runs on the loss times it (the optimizer's ``loss_scale`` for float16 models, megatron-core's
    ``grad_scale_func``), so sketches and gradients come out multiplied by it; the reported losses are not."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    if not microbatches:
        raise ValueError("forward_backward needs at least one micro-batch")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    device = model_device(chunks)
    microbatches = [b.to(device) for b in microbatches]  # data is built on the host
    mb, seq = microbatches[0].tokens.shape
    fb = get_forward_backward_func()
    config = get_model_config(chunks[0])
    unscaled = config.grad_scale_func
    if grad_scale != 1.0 and not forward_only:
        config.grad_scale_func = partial(_scale_loss, grad_scale)
    try:
        outputs = fb(
            forward_step_func=_lm_forward_step if loss_fn is None else partial(_custom_forward_step, loss_fn),
            data_iterator=iter(microbatches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(microbatches),
            seq_length=seq,
            micro_batch_size=mb,
            forward_only=forward_only,
        )
    finally:
        config.grad_scale_func = unscaled
    num_tokens = int(sum(int(b.loss_mask.sum()) for b in microbatches))
    device = microbatches[0].tokens.device
    keys = sorted(outputs[0].keys()) if groups.pp_last and outputs else ["lm"]
    sizes = [2] + [outputs[0][k].numel() for k in keys if k != "lm"] if groups.pp_last and outputs else None
    names = ["lm"] + [k for k in keys if k != "lm"]
    if groups.pp_size > 1:
        # only the last stage knows the report layout: share it
        meta = torch.tensor([len(names)] + (sizes or [0] * len(names)), dtype=torch.int64, device=device) \
            if groups.pp_last else None
        sizes = _broadcast_sizes(meta, groups, device)
        names = _report_names(loss_fn, len(sizes))
    total = sum(sizes)
    stats = torch.zeros(total, dtype=torch.float64, device=device)
    if groups.pp_last:
        for out in outputs:
            stats += torch.cat([out[k].double().reshape(-1) for k in names])
    all_reduce_sum(stats, groups.dp)
    if groups.pp_size > 1:  # only the last stage computed the loss
        all_reduce_sum(stats, groups.pp)
    global_tokens = torch.tensor([float(num_tokens)], dtype=torch.float64, device=device)
    all_reduce_sum(global_tokens, groups.dp)
    reports, offset = {}, 0
    for name, size in zip(names, sizes):
        reports[name] = stats[offset : offset + size].clone()
        offset += size
    return StepResult(reports=reports, loss_sum=reports["lm"][0].item(), num_tokens=num_tokens,
                      global_tokens=int(global_tokens.item()))


def _broadcast_sizes(meta: Optional[torch.Tensor], groups: ParallelGroups, device) -> list[int]:
    import torch.distributed as dist

    last = dist.get_global_rank(groups.pp, groups.pp_size - 1)
    count = torch.zeros(1, dtype=torch.int64, device=device) if meta is None else meta[:1].clone()
    dist.broadcast(count, src=last, group=groups.pp)
    buf = torch.zeros(1 + int(count.item()), dtype=torch.int64, device=device) if meta is None else meta.clone()
    dist.broadcast(buf, src=last, group=groups.pp)
    return [int(x) for x in buf[1:].tolist()]


def _report_names(loss_fn: Optional[LossFn], count: int) -> list[str]:
    names = getattr(loss_fn, "report_names", None)
    if names is None:
        if count != 1:
            raise ValueError("a custom loss_fn used with pipeline parallelism must declare report_names")
        return ["lm"]
    return ["lm"] + [n for n in sorted(names) if n != "lm"]
