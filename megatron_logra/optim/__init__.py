"""Optimizers: LoGRA (RowAdam / SGD on sketches, both recipes) and dense AdamW."""

from __future__ import annotations

from typing import Sequence, Union

from torch import nn

from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
from megatron_logra.optim.dense import DenseAdamW
from megatron_logra.optim.logra import LograOptimizer
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.parallel import ParallelGroups

__all__ = ["LograConfig", "NativeConfig", "OptimizerConfig", "LograOptimizer", "DenseAdamW", "PreparedUpdate",
           "build_optimizer"]


def build_optimizer(
    model: Union[nn.Module, Sequence[nn.Module]], cfg: OptimizerConfig, groups: ParallelGroups
) -> Union[LograOptimizer, DenseAdamW]:
    """LoGRA or dense AdamW, as ``cfg.name`` says."""
    if cfg.name == "logra":
        return LograOptimizer(model, cfg.logra, cfg.native, groups)
    return DenseAdamW(model, cfg.native, groups, clip_grad=cfg.logra.clip_grad)
