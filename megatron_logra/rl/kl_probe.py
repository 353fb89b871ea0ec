"""Inputs of the RL step's KL control: the probe batch and the finite-difference probe's step sizes.

Contract: :func:`_probe_batch` takes the first ``kl.probe_sequences`` sequences of the step's batch that
have a completion token, capped at ``kl.probe_max_tokens`` valid positions; :func:`fd_steps` sizes the
finite-difference steps of the targets and of the trained non-targets each by its own relative change
(collective over the model-parallel group). The KL prediction itself is :mod:`megatron_logra.kl`'s.
"""

from __future__ import annotations

import torch

from megatron_logra.kl.controller import KLConfig
from megatron_logra.kl.fd_probe import fd_step
from megatron_logra.kl.probe import NativeDeltas, ProbeBatch
from megatron_logra.optim import LograOptimizer
from megatron_logra.train.step import Batch

__all__ = ["fd_steps"]


def fd_steps(kl: KLConfig, optimizer: LograOptimizer, ratio_at_1: float, native: NativeDeltas) -> tuple[float, float]:
    """The finite-difference probe's steps ``(h, h')`` for the targets and the trained non-targets, each
    sized by its own relative change at α = 1 (:func:`fd_step`): the natives' AdamW change is often far
    larger than the targets' KL-controlled one, and the targets' ``h`` would carry it out of the range of
    the second-order prediction. ``h' = h`` (one joint difference, three forwards) when no rank of the
    model-parallel group trains natives or they do not move. Collective over the model-parallel group
    (the natives' norm)."""
    dtype = optimizer.targets[0].weight.dtype
    h = fd_step(kl.fd_step, kl.fd_min_relative, ratio_at_1, dtype)
    native_ratio = optimizer.native_relative_update_norm(native)  # 0 on every rank when no rank trains natives
    return h, (fd_step(kl.fd_step, kl.fd_min_relative, native_ratio, dtype) if native_ratio > 0 else h)


def _probe_batch(batch: Batch, kl_cfg, device: torch.device) -> ProbeBatch:
    """The first ``kl.probe_sequences`` sequences with a completion token (an empty completion has no valid
    position), at most ``kl.probe_max_tokens`` valid positions, on ``device``."""
    rows = (batch.loss_mask.sum(dim=1) > 0).nonzero().flatten()[: kl_cfg.probe_sequences]
    tokens, pos, mask = batch.tokens[rows], batch.position_ids[rows], batch.loss_mask[rows].clone()
    # cap the probe's token count
    flat = mask.reshape(-1)
    keep = torch.cumsum(flat, 0) <= kl_cfg.probe_max_tokens
    mask = (flat * keep).view_as(mask)
    return ProbeBatch(tokens, pos, mask).to(device)
