"""What ``prepare`` hands to a step-size controller and ``apply`` consumes, shared by the optimizers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn

__all__ = ["PreparedUpdate", "module_params"]


@dataclass
class PreparedUpdate:
    """A step that is ready to apply: ``ΔW_t = −α·D_t·A_t`` for each target ``t``."""

    step: int
    """1-based optimizer step this update becomes when applied."""
    update_index: int
    """Projection update index the sketches were taken with."""
    skipped: bool = False
    """True when the step must not be applied (reason says why)."""
    reason: Optional[str] = None
    overflow: bool = False
    """True when the step was skipped for a float16 overflow that a smaller loss scale cures (the scale was
    lowered or is on its way down: routine, not a bad step); False for every other skip."""
    loss_scale: Optional[float] = None
    """The loss scale this step's backward ran at (:mod:`megatron_logra.optim.loss_scale`); None unscaled."""
    directions: dict[str, torch.Tensor] = field(default_factory=dict)
    """Target key -> scaled direction ``D`` ``[n_out_local, r]``."""
    grad_norm: float = float("nan")
    """Global norm of the reconstructed gradient plus native grads (after reduction, before clipping)."""
    clip_coef: float = 1.0
    num_tokens: Optional[int] = None
    """Global valid tokens the sketches were normalised by (paper recipe)."""
    scale: float = 1.0
    """Global scale folded into ``D`` (the scheduled lr ``logra.lr × lr_multiplier``, or the update-ratio
    scale of the paper recipe)."""
    lr_multiplier: float = 1.0
    """The learning-rate schedule's factor for this step (:func:`megatron_logra.optim.schedule.lr_multiplier`),
    already folded into ``D``, the native AdamW's lr and the weight-decay factor; 1.0 without a schedule."""


def module_params(model: Union[nn.Module, Sequence[nn.Module]]) -> list[nn.Parameter]:
    """Unique parameters of a model or of its pipeline chunks, in order."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    seen, out = set(), []
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
