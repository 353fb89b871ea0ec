"""Layout-independent optimizer state for sharded checkpoints.

An optimizer describes its state as two parts (:meth:`sharded_state`):

* **slots** — every state tensor that is laid out like a model parameter (AdamW moments, fp32
  masters: ``like="param"``) or like the parameter's output rows (LoGRA's per-row second
  moments ``[n_out_local]``: ``like="rows"``). The checkpoint gives each slot the sharding of
  its parameter, so it can be reloaded under another tensor/pipeline/data-parallel layout.
* **scalars** — JSON values that are the same on every rank and in every layout (step
  counters, learning rate, controller state).

Loading calls :meth:`sharded_state` on the fresh optimizer, fills the returned slot tensors in
place from the checkpoint, and hands them back with the saved scalars to
:meth:`load_sharded_state`, which installs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ParamSlot", "SlotState"]


@dataclass
class ParamSlot:
    """One optimizer state tensor and the parameter whose sharding it shares."""

    name: str
    """Layout-independent state name, e.g. ``native.exp_avg`` (the checkpoint key is
    ``optimizer.<name>.<parameter's checkpoint key>``)."""
    param: nn.Parameter
    """The model parameter this state belongs to."""
    tensor: torch.Tensor
    """The state itself: the optimizer's own storage (loading writes into it)."""
    like: str = "param"
    """``param``: same shape as ``param``; ``rows``: a ``[n_out_local]`` vector, one value per
    output row of ``param``."""

    def __post_init__(self) -> None:
        if self.like == "param":
            ok = tuple(self.tensor.shape) == tuple(self.param.shape)
        elif self.like == "rows":
            ok = self.tensor.dim() == 1 and self.param.dim() == 2 and self.tensor.shape[0] == self.param.shape[0]
        else:
            raise ValueError(f"ParamSlot.like={self.like!r}: choose 'param' or 'rows'")
        assert ok, f"slot {self.name}: tensor {tuple(self.tensor.shape)} is not laid out {self.like}-like " \
                   f"parameter {tuple(self.param.shape)}"


SlotState = tuple[dict[str, Any], list[ParamSlot]]
"""``(scalars, slots)`` as returned by ``sharded_state()``."""
