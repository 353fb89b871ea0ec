"""What an RL update works on and carries: :class:`RLComponents` (the live objects, built by
``rl.components.build_components``) and :class:`RLState` (the loop's own counters and reward baseline).

:meth:`RLState.state_dict` is what a checkpoint holds of the loop: the completed updates (``step``), the engine's
``weight_version`` and the EMA baseline; ``bad_streak`` is not saved. Both are importable from
:mod:`megatron_logra.rl.loop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_logra.kl.controller import KLController
from megatron_logra.parallel import ParallelGroups
from megatron_logra.rl.advantages import EMABaseline

__all__ = ["RLComponents", "RLState"]


@dataclass
class RLState:
    """Everything the loop itself must checkpoint."""

    step: int = 0
    """Completed RL updates."""
    weight_version: int = 0
    """Version of the policy the engine holds."""
    baseline: EMABaseline = field(default_factory=EMABaseline)
    bad_streak: int = 0
    """RL steps in a row that refused their update (``rl.step_guard``); not checkpointed."""

    def state_dict(self) -> dict:
        return {"step": self.step, "weight_version": self.weight_version, "baseline": self.baseline.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.weight_version = int(state["weight_version"])
        self.baseline.load_state_dict(state["baseline"])


@dataclass
class RLComponents:
    """The live objects an update works on (built by ``rl.components.build_components``)."""

    cfg: Any
    """RunConfig."""
    groups: ParallelGroups
    model: torch.nn.Module
    optimizer: Any
    controller: KLController
    engine: Any
    task: Any
    tokenizer: Any
    sync: Any
    """``PolicySync`` that brings the engine to the trainer's new weights after each update."""
    ref_model: Optional[torch.nn.Module] = None
    stop_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion (``data.tokenizer.stop_token_ids`` and ``rl.rollout.stop_token_ids``);
    empty: the tokenizer's EOS."""
    sample_log: Any = None
    """The run's :class:`~megatron_logra.rl.sample_log.SampleLog` (``rl.log_samples``), set by the job; None:
    nothing is logged (``megatron-logra eval``, ``rl.log_samples=0``)."""

    def stop_token_ids(self) -> list[int]:
        return self.stop_ids or [self.tokenizer.eos_token_id]
