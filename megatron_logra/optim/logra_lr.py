"""The learning rates of a LoGRA step: the schedule's lrs and the decoupled weight-decay factor.

A schedule (:mod:`megatron_logra.optim.schedule`) scales, per step, the optimizer recipe's target lr
(folded into the directions ``D``), its weight-decay factor and the native AdamW's lr. These are pure
functions of the step number and the configuration, shared by :meth:`LograOptimizer.prepare`, ``apply``
and the metrics record, so all three use the same lr for the same step.
"""

from __future__ import annotations

from typing import Optional

from megatron_logra.optim.schedule import lr_multiplier, scheduled_lr
from megatron_logra.optim.update import PreparedUpdate

__all__ = ["LograScheduleMixin"]


class LograScheduleMixin:
    """Scheduled lrs of :class:`~megatron_logra.optim.logra.LograOptimizer`; needs ``cfg``, ``schedule``,
    ``total_steps``, ``native`` and ``num_steps`` on the optimizer."""

    def _lr_multiplier(self, step: int) -> float:
        """The schedule's factor for 1-based ``step`` (1.0 without a schedule)."""
        if self.schedule is None:
            return 1.0
        return lr_multiplier(step, self.schedule, self.total_steps, self._reference_lr())

    def _reference_lr(self) -> float:
        """The lr ``--lr`` sets, which an absolute ``optimizer.schedule.min_lr`` is the floor of: the targets' for
        the optimizer recipe, else the non-target AdamW's (``OptimizerConfig.scheduled_lrs``)."""
        return self.cfg.lr if self.cfg.recipe == "optimizer" else self.native.base_lr

    def _scheduled(self, peak: float, step: int) -> float:
        """The configured lr ``peak`` after the schedule at 1-based ``step`` (``peak`` without a schedule): at
        the floor of the decay exactly the floor lr (:func:`~megatron_logra.optim.schedule.scheduled_lr`)."""
        if self.schedule is None:
            return peak
        return scheduled_lr(peak, step, self.schedule, self.total_steps, self._reference_lr())

    def step_lrs(self, update: PreparedUpdate) -> dict[str, Optional[float]]:
        """The learning rates ``update`` is (or was) applied with, after the schedule, for a step's metrics
        record: ``lr``, the native AdamW's (None when the non-targets are frozen), and ``logra_lr``, the
        targets' (optimizer recipe; None for the paper recipe, whose step follows the KL controller). Both
        None for a skipped update."""
        if update.skipped:
            return {"lr": None, "logra_lr": None}
        native = self._scheduled(self.native.base_lr, update.step) if self.native.params else None
        logra = self._scheduled(self.cfg.lr, update.step) if self.cfg.recipe == "optimizer" else None
        return {"lr": native, "logra_lr": logra}

    def weight_decay_factor(self, update: Optional[PreparedUpdate] = None) -> float:
        """``decay`` of ``W ← decay·W − ΔW`` for ``update`` (None: the next step to be prepared):
        ``1 − lr_t·wd`` with ``lr_t`` the scheduled lr of its step (``lr·m``, the schedule's multiplier ``m``; exactly
        ``schedule.min_lr`` at the floor: ``scheduled_lr``) for the optimizer recipe, or 1 (paper recipe)."""
        cfg = self.cfg
        if cfg.recipe != "optimizer":
            return 1.0
        step = update.step if update is not None else self.num_steps + 1
        return 1.0 - self._scheduled(cfg.lr, step) * cfg.weight_decay
