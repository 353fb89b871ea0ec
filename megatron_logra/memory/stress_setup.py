"""Pieces of ``tools/memory_stress.py``: the planner's prediction for its step, the optimizer state counted
from the objects, and a synthetic RL batch."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_logra.memory.measure import available_bytes

__all__ = ["predicted", "optimizer_state_bytes", "make_batch", "host_shortfall", "out_of_memory"]


def predicted(mcfg, kind: str, args, world: int) -> tuple[int, int]:
    """(trainer peak, optimizer state) bytes of one rank from the memory planner."""
    from megatron_logra.memory import PlanConfig, plan
    from megatron_logra.memory.preflight import attention_kernel

    # the tool applies every step at α = 1 (no KL controller): LoGRA's native AdamW step copies no masters
    p = plan(mcfg, PlanConfig(tp=args.tp, dp=max(1, world // args.tp), optimizer=kind, rank=args.rank,
                              masters=args.masters, micro_batch=args.micro_batch, seq_len=args.seq_len,
                              recompute=args.recompute, distributed_optimizer=False, overhead_bytes=0,
                              logprob_chunk_tokens=args.chunk_tokens, loss="lm" if args.loss == "lm" else "logprob",
                              policy_sync=False, attention=attention_kernel(mcfg), scaled_native_step=False))
    w = p.worst
    return w.trainer_peak, w.grads + w.masters + w.moments + w.sketches + w.row_moments


def optimizer_state_bytes(opt) -> int:
    """Bytes of the unique storages the optimizer keeps across steps (weights excluded)."""
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()

    native = opt.native
    for p, m in zip(native.params, native.masters):
        add(p.grad)
        add(getattr(p, "main_grad", None))
        if m is not p:
            add(m)
    if native.inner is not None:
        for state in native.inner.state.values():
            for v in state.values():
                add(v)
    if hasattr(opt, "sketches"):
        add(opt.sketches.flat)
        for v in list(opt.row_moments.values()) + list(opt.masters.values()):
            add(v)
    return total



def make_batch(mcfg, args, device, seed: int):
    from megatron_logra.train.step import Batch

    gen = torch.Generator().manual_seed(seed)
    b, s = args.micro_batch, args.seq_len
    tokens = torch.randint(0, mcfg.vocab_size, (b, s), generator=gen)
    mask = torch.ones(b, s)
    mask[:, : s // 4] = 0.0  # a prompt part outside the loss
    extras = {"advantages": torch.randn(b, 1, generator=gen).expand(b, s).contiguous(),
              "rollout_logprobs": torch.full((b, s), -2.0), "finished": torch.ones(b, s)}
    return Batch(tokens.to(device), torch.roll(tokens, -1, dims=1).to(device), mask.to(device),
                 torch.arange(s)[None].expand(b, s).contiguous().to(device), {k: v.to(device) for k, v in extras.items()})


def host_shortfall(peak: int) -> Optional[str]:
    """Why a CPU run whose planned peak per process is ``peak`` bytes cannot fit in this host's available
    memory (times torchrun's ``LOCAL_WORLD_SIZE`` processes), or None when it fits or nothing says."""
    have, local = available_bytes(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if have is None or peak * local <= have:
        return None
    times = f" x {local} processes" if local > 1 else ""
    return (f"the planner predicts a {peak / 2 ** 30:.2f} GiB peak per process{times}, more than the "
            f"{have / 2 ** 30:.2f} GiB of host memory available")


def out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: ``MemoryError``, torch's CUDA ``OutOfMemoryError`` or the CPU allocator's error."""
    text = str(exc)
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and (
        "out of memory" in text.lower() or "can't allocate memory" in text))
