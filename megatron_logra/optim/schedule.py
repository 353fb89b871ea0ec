"""Learning-rate schedule (warmup + decay) with Megatron-LM's semantics, as a pure function of the step.

Every learning rate an optimizer owns is its configured (peak) value times one multiplier,
:func:`lr_multiplier`, of the 1-based optimizer step being taken:

* the LoGRA optimizer recipe's target lr (``optimizer.logra.lr``): the update scale of the
  directions and the decoupled weight-decay factor ``1 − lr·m·wd``;
* the native AdamW of the non-target parameters (``optimizer.native.lr``);
* dense AdamW (``optimizer.name=adam``, ``optimizer.native.lr``).

The paper recipe has no target lr (its step is ``logra.update_ratio`` times the KL controller's
α): there the schedule changes the native AdamW only.

Semantics (megatron-core's ``OptimizerParamScheduler.get_lr`` counted in optimizer steps: the scheduler
starts at 0 and advances by one after each successful update, so the ``t``-th update uses the lr of
``n = t − 1`` completed steps). Megatron-LM's loop counts the same scheduler in samples (warmup and decay
lengths times the global batch size ``G``, advanced by ``G`` per update); every style gives the same lr
in either unit except ``inverse-square-root`` without warmup, where Megatron-LM's ``max(W·G, 1)`` makes
its lr ``peak / sqrt(n·G)`` (``peak / sqrt(G)`` on the second update) and this one's ``peak / sqrt(n)``.
With ``W`` = ``warmup_steps``, ``D`` = the decay steps, ``r0`` = ``warmup_init_ratio`` (or ``warmup_init_lr`` /
the reference lr, see :attr:`LRScheduleConfig.warmup_init_lr`) and ``rmin`` = ``min_lr_ratio`` (or ``min_lr`` /
the reference lr, see :attr:`LRScheduleConfig.min_lr`):

* ``W > 0`` and ``n ≤ W``: ``r0 + (1 − r0)·n/W`` (so the first update of a warmup starting at 0 has
  lr 0, its moments still advance, as in Megatron-LM);
* ``constant``: 1;
* ``n > D``: ``rmin``;
* ``inverse-square-root``: ``max(rmin, sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
* ``linear`` / ``cosine``: ``rmin + (1 − rmin)·c`` with ``c = 1 − q`` / ``½(1 + cos πq)``,
  ``q = (n − W)/(D − W)``.

An lr at one of the schedule's absolute lrs (:data:`ABSOLUTE_LRS`) is that lr itself, :func:`scheduled_lr`: at the
first step of the warmup (``n = 0``) ``warmup_init_lr``, at the floor (after the decay, at its last step, or where the
inverse square root is below the floor) ``min_lr``, exactly as given for the reference lr (Megatron-LM's
``--lr-warmup-init`` / ``--min-lr``, which ``peak × (value / peak)`` can miss by one unit in the last place). The other
steps of the warmup take ``peak × (r0 + (1 − r0)·n/W)``, Megatron-LM's ``init + (peak − init)·n/W``.

The function is stateless: the step counter the optimizers already checkpoint is all a resume needs,
so a resumed run takes bitwise the steps of an uninterrupted one. Skipped updates (non-finite
gradients) do not advance the step, as Megatron-LM skips its scheduler step then. The schedule's section,
:class:`LRScheduleConfig`, and its checks live in :mod:`megatron_logra.optim.schedule_config` (importable from here).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from megatron_logra.optim.schedule_config import ABSOLUTE_LRS, DECAY_STYLES, LRScheduleConfig

logger = logging.getLogger(__name__)

__all__ = ["ABSOLUTE_LRS", "DECAY_STYLES", "LRScheduleConfig", "lr_multiplier", "scheduled_lr"]


def lr_multiplier(step: int, cfg: LRScheduleConfig, total_steps: Optional[int] = None,
                  reference_lr: Optional[float] = None) -> float:
    """The factor every peak lr is multiplied by for the 1-based optimizer step ``step`` (see the module
    docstring): megatron-core's ``OptimizerParamScheduler.get_lr`` / peak after ``step − 1`` completed steps,
    for the schedule ``cfg`` whose decay ends at ``cfg.decay_steps`` or, when None, at ``total_steps`` (the
    job's optimizer steps). ``reference_lr``: the lr ``--lr`` sets, needed when ``cfg.min_lr`` or
    ``cfg.warmup_init_lr`` is set (:meth:`LRScheduleConfig.fraction`). Exactly 1.0 for ``constant`` without
    warmup. ``ValueError`` for ``step < 1`` and as :meth:`LRScheduleConfig.resolve_decay_steps` says."""
    return _multiplier(step, cfg, total_steps, reference_lr)[0]


def scheduled_lr(peak: float, step: int, cfg: LRScheduleConfig, total_steps: Optional[int] = None,
                 reference_lr: Optional[float] = None) -> float:
    """The lr of the 1-based optimizer step ``step`` for the configured (peak) lr ``peak``: ``peak ×``
    :func:`lr_multiplier`, except where the schedule is at one of its absolute lrs (:data:`ABSOLUTE_LRS`) and that
    one is set: the first step of the warmup (``cfg.warmup_init_lr``) and the floor of the decay (``cfg.min_lr``).
    There it is that lr exactly for the reference lr (``peak == reference_lr``, the one ``--lr`` sets), and
    ``value × peak / reference_lr`` for the others. Arguments and errors as :func:`lr_multiplier`."""
    multiplier, at = _multiplier(step, cfg, total_steps, reference_lr)
    value = getattr(cfg, at) if at is not None else None
    if value is not None:
        if peak == reference_lr:
            return float(value)
        if reference_lr:  # a reference lr of 0 makes the fraction 0 (LRScheduleConfig.fraction): every lr is 0
            return float(value) * (peak / reference_lr)
    return peak * multiplier


def _multiplier(step: int, cfg: LRScheduleConfig, total_steps: Optional[int],
                reference_lr: Optional[float]) -> tuple[float, Optional[str]]:
    """``(lr_multiplier, the absolute lr the step is at)``: ``"warmup_init_lr"`` at the first step of the warmup,
    ``"min_lr"`` at the floor of the decay, else None (keys of :data:`ABSOLUTE_LRS`)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r} must be an integer >= 1 (the 1-based optimizer step being taken)")
    n = step - 1  # completed steps: what Megatron-LM's scheduler has counted when the step runs
    warmup = cfg.warmup_steps
    if warmup > 0 and n <= warmup:
        init = cfg.fraction("warmup_init_lr", reference_lr)
        return init + (1.0 - init) * (float(n) / float(warmup)), "warmup_init_lr" if n == 0 else None
    if not cfg.decays:
        return 1.0, None
    decay_steps = cfg.resolve_decay_steps(total_steps)
    floor = cfg.floor_ratio(reference_lr)
    if n > decay_steps:
        return floor, "min_lr"
    if cfg.decay_style == "inverse-square-root":
        value = math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
        return (floor, "min_lr") if floor >= value else (value, None)
    progress = float(n - warmup) / float(decay_steps - warmup)
    if cfg.decay_style == "linear":
        coeff = 1.0 - progress
    else:  # cosine
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return floor + coeff * (1.0 - floor), "min_lr" if coeff == 0.0 else None
