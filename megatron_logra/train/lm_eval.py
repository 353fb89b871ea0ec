"""Held-out evaluation of the LM job: which eval sequences, spread over the DP ranks, and the loss on them.

The held-out set is eval sequences ``0 .. n - 1`` (:func:`eval_sequence_count`) whatever
``train.micro_batch_size`` and the DP layout, so losses of runs with different batch layouts compare.
:func:`evaluate` is what :func:`megatron_logra.train.lm.run_lm` measures before, during and after training;
:func:`evaluate_checkpoint` measures a saved run's latest checkpoint (``megatron-logra evaluate``).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_logra.checkpoint import latest_checkpoint, load_checkpoint
from megatron_logra.config import RunConfig
from megatron_logra.data.synthetic import SyntheticTask
from megatron_logra.metrics import is_rank0
from megatron_logra.models.gpt import build_gpt
from megatron_logra.optim import LograOptimizer, build_optimizer
from megatron_logra.parallel import ParallelGroups, initialize_parallel
from megatron_logra.train.step import forward_backward

logger = logging.getLogger(__name__)

__all__ = ["evaluate", "evaluate_checkpoint", "eval_assignment", "eval_sequence_count",
           "warn_deprecated_eval_batches"]


def eval_assignment(num_batches: int, dp_size: int, dp_rank: int) -> list[Optional[int]]:
    """Held-out micro-batches of DP rank ``dp_rank``: batch ``i`` goes to rank ``i % dp_size``, and a
    rank with fewer than ``ceil(num_batches / dp_size)`` (at least one) is padded with ``None``
    (an all-masked micro-batch), so every rank runs the same number and the DP ranks together
    evaluate exactly batches ``0 .. num_batches - 1``."""
    if num_batches < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"eval_assignment(num_batches={num_batches}, dp_size={dp_size}, dp_rank={dp_rank})")
    per_rank = -(-num_batches // dp_size)
    mine: list[Optional[int]] = list(range(dp_rank, num_batches, dp_size))
    return mine + [None] * (per_rank - len(mine))


def eval_sequence_count(cfg: RunConfig) -> int:
    """Held-out sequences per evaluation: ``train.eval_sequences``, or, for a config that sets the deprecated
    ``train.eval_batches``, ``train.eval_batches × train.micro_batch_size`` (what it always meant)."""
    if cfg.train.eval_batches is not None:
        return cfg.train.eval_batches * cfg.train.micro_batch_size
    return cfg.train.eval_sequences


def warn_deprecated_eval_batches(cfg: RunConfig) -> None:
    """Warn (the caller: rank 0) that a config sets the deprecated ``train.eval_batches``, naming the
    ``train.eval_sequences`` value that evaluates the same sequences whatever the micro-batch size."""
    if cfg.train.eval_batches is not None:
        logger.warning("train.eval_batches=%d is deprecated: it evaluates %d micro-batches of train.micro_batch_size="
                       "%d (%d held-out sequences, a set that changes with the micro-batch size); give "
                       "train.eval_batches=null train.eval_sequences=%d for the same sequences whatever the "
                       "micro-batch size", cfg.train.eval_batches, cfg.train.eval_batches,
                       cfg.train.micro_batch_size, eval_sequence_count(cfg), eval_sequence_count(cfg))


@torch.no_grad()
def evaluate(model, task: SyntheticTask, cfg: RunConfig, groups: ParallelGroups, optimizer: Any) -> float:
    """Mean held-out loss per answer token over eval sequences ``0 .. n - 1`` (``n`` =
    :func:`eval_sequence_count`, ``train.eval_sequences``): the same tokens whatever ``train.micro_batch_size``
    and the DP layout. They run in micro-batches of ``train.micro_batch_size`` (the rows of the last one past
    ``n`` are masked), spread over the DP ranks by :func:`eval_assignment` (padding micro-batches count no
    tokens). The eval sequences are never trained on (the synthetic task's eval-only contents, see
    ``data/synthetic.py``)."""
    model.eval()
    paused = optimizer.sketches.paused() if isinstance(optimizer, LograOptimizer) else nullcontext()
    size = cfg.train.micro_batch_size
    count = eval_sequence_count(cfg)
    with paused:
        mbs = []
        for index in eval_assignment(-(-count // size), groups.dp_size, groups.dp_rank):
            if index is None:  # padding: same shape, no token counts
                pad = task.microbatch(0, 0, size, split="eval")
                mbs.append(replace(pad, loss_mask=torch.zeros_like(pad.loss_mask)))
                continue
            mb = task.microbatch(0, index, size, split="eval")  # sequences index·size .. index·size + size - 1
            beyond = (index + 1) * size - count
            if beyond > 0:  # the last micro-batch: rows past sequence count - 1 count no tokens
                mask = mb.loss_mask.clone()
                mask[size - beyond:] = 0
                mb = replace(mb, loss_mask=mask)
            mbs.append(mb)
        result = forward_backward(model, mbs, groups, forward_only=True)
    model.train()
    return result.loss


def evaluate_checkpoint(cfg: RunConfig, checkpoint: Optional[Path] = None) -> dict:
    """Held-out loss of ``checkpoint`` (default: the latest one in ``cfg.train.run_dir``)."""
    groups = initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    if is_rank0():
        warn_deprecated_eval_batches(cfg)
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optimizer, groups, total_steps=cfg.train.steps)
    ckpt = checkpoint or latest_checkpoint(cfg.train.run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{cfg.train.run_dir} has no checkpoint")
    step = load_checkpoint(ckpt, model, optimizer, groups, checksums=cfg.train.checkpoint_checksums,
                           model_config=cfg.model, training=False)["step"]
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    return {"run_dir": cfg.train.run_dir, "step": step, "eval_loss": evaluate(model, task, cfg, groups, optimizer)}

