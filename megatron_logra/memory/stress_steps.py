"""The measured steps of ``tools/memory_stress.py``: one optimizer's training steps and each step's readings.

:func:`run_kind` builds the GPT and the optimizer (``logra`` or ``adam``) on process groups made once for every
kind, runs ``args.steps`` full steps (forward/backward of the RL loss, or megatron's LM loss; ``prepare``;
``apply``) and returns one row per step: the readings of :data:`~megatron_logra.memory.stress_report.MEASURED`
(CUDA peaks and the NVML sample, or the CPU's live-tensor peak and peak RSS; the optimizer state counted from the
objects; the step's seconds), each the maximum over ranks (None: not measured), beside the planner's prediction.
A row is appended as its step ends, so the steps measured before a failure are kept.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import nullcontext
from typing import Optional

import torch

from megatron_logra.memory.measure import LiveTensorTracker
from megatron_logra.memory.measure import maxrss_bytes as _maxrss_bytes
from megatron_logra.memory.measure import reset_peak_rss as _reset_peak_rss
from megatron_logra.memory.stress_report import MEASURED, NvmlSampler
from megatron_logra.memory.stress_setup import make_batch, optimizer_state_bytes, predicted

__all__ = ["run_kind"]

logger = logging.getLogger("memory_stress")


def run_kind(kind: str, mcfg, args, device: torch.device, world: int, groups, into: Optional[list] = None) -> list[dict]:
    """Steps of one optimizer ``kind`` on ``groups`` (made once for every kind: megatron's teardown keeps the
    process groups, so making them again per kind would leave the earlier NCCL communicators' buffers in the
    next kind's memory peak). Each step's row is appended to ``into`` (kept if a later step fails) too."""
    import torch.distributed as dist

    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.rl.loop import make_rl_loss_fn
    from megatron_logra.rl.losses import LossConfig
    from megatron_logra.train.step import forward_backward

    model = build_gpt(mcfg, groups, seed=1)
    if device.type == "cuda":
        model = model.cuda()
    ocfg = OptimizerConfig(name="adam" if kind == "adam" else "logra", native=NativeConfig(lr=1e-5),
                           logra=LograConfig(rank=args.rank, masters=args.masters, lr=1e-5))
    opt = build_optimizer(model, ocfg, groups)
    loss_fn = make_rl_loss_fn(LossConfig(logprob_chunk_tokens=args.chunk_tokens), 1.0, groups.tp) \
        if args.loss == "rl" else None
    pred_peak, pred_state = predicted(mcfg, kind, args, world)
    cuda = device.type == "cuda"
    nvml = NvmlSampler() if cuda else None
    rows = [] if into is None else into
    for step in range(1, args.steps + 1):
        batches = [make_batch(mcfg, args, device, 1000 * step + i) for i in range(args.micro_batches)]
        gc.collect()
        tracker = LiveTensorTracker() if (not cuda and args.track_tensors) else None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()
        t0 = time.perf_counter()
        with nvml or nullcontext(), tracker or nullcontext():
            opt.zero_grad()
            res = forward_backward(model, batches, groups, loss_fn=loss_fn)
            opt.apply(opt.prepare(num_tokens=res.num_tokens))
            if cuda:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        vals = {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "nvml_peak_used_bytes": nvml.peak if nvml is not None else None,
            "live_tensor_peak_bytes": tracker.peak if tracker is not None else None,
            "peak_rss_bytes": None if cuda else _maxrss_bytes(),
            "optimizer_state_bytes": optimizer_state_bytes(opt),
            "step_seconds": seconds,
        }
        # worst rank: the maximum of each reading over the world (-1 = not measured)
        t = torch.tensor([float(-1 if vals[k] is None else vals[k]) for k in MEASURED], dtype=torch.float64,
                         device=device)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        vals = {k: (None if v < 0 else (v if k == "step_seconds" else int(v))) for k, v in zip(MEASURED, t.tolist())}
        rows.append({"optimizer": kind, "step": step, "device": device.type, "world": world, "tp": args.tp,
                     "tokens_per_step": args.micro_batch * args.seq_len * args.micro_batches * max(1, world // args.tp),
                     **vals, "predicted_peak_bytes": pred_peak, "predicted_optimizer_state_bytes": pred_state,
                     "loss": res.loss})
        logger.info("%s step %d: %s", kind, step, {k: v for k, v in vals.items() if v is not None})
    del model, opt, loss_fn
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows
