"""Optimizers: LoGRA (RowAdam / SGD on sketches, both recipes) and dense AdamW."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from torch import nn

from megatron_logra.optim.config import LograConfig, LossScaleConfig, NativeConfig, OptimizerConfig
from megatron_logra.optim.dense import DenseAdamW
from megatron_logra.optim.logra import LograOptimizer
from megatron_logra.optim.schedule import LRScheduleConfig, lr_multiplier
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.parallel import ParallelGroups

__all__ = ["LograConfig", "LossScaleConfig", "NativeConfig", "OptimizerConfig", "LRScheduleConfig", "LograOptimizer", "DenseAdamW",
           "PreparedUpdate", "build_optimizer", "lr_multiplier"]


def build_optimizer(
    model: Union[nn.Module, Sequence[nn.Module]], cfg: OptimizerConfig, groups: ParallelGroups,
    *, total_steps: Optional[int] = None,
) -> Union[LograOptimizer, DenseAdamW]:
    """LoGRA or dense AdamW, as ``cfg.name`` says, following the lr schedule ``cfg.schedule``. ``total_steps``:
    the job's optimizer steps (``train.steps`` / ``rl.steps``), which a schedule without ``decay_steps`` decays
    over; a decaying schedule without either is a ``ValueError``."""
    if cfg.name == "logra":
        return LograOptimizer(model, cfg.logra, cfg.native, groups, schedule=cfg.schedule, total_steps=total_steps,
                              loss_scale=cfg.loss_scale)
    return DenseAdamW(model, cfg.native, groups, clip_grad=cfg.logra.clip_grad, schedule=cfg.schedule,
                      total_steps=total_steps, loss_scale=cfg.loss_scale)
