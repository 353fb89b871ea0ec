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
gradients) do not advance the step, as Megatron-LM skips its scheduler step then.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["ABSOLUTE_LRS", "DECAY_STYLES", "LRScheduleConfig", "lr_multiplier", "scheduled_lr"]

DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine", "inverse-square-root")
"""Accepted ``decay_style`` values (Megatron-LM's ``--lr-decay-style`` spellings; WSD is not offered)."""

ABSOLUTE_LRS: dict[str, str] = {"warmup_init_lr": "warmup_init_ratio", "min_lr": "min_lr_ratio"}
"""The schedule's absolute lrs (fields of :class:`LRScheduleConfig`, set by Megatron-LM's ``--lr-warmup-init`` and
``--min-lr``) -> the fraction-of-the-peak field each one replaces. Either may be given, not both (a ratio of 0
counts as not given). Configs saved before an absolute field existed kept its flag's value as that ratio
(``value / peak``); resuming them with the flag again is not a change (``megatron_logra.cli.resume_differences``,
``megatron_logra.config.overrides``)."""

_ABSOLUTE_ROLES: dict[str, tuple[str, str, str]] = {  # field -> (flag, what it sets, why it cannot exceed the peak)
    "warmup_init_lr": ("--lr-warmup-init", "the start of the warmup", "the warmup runs up to the peak"),
    "min_lr": ("--min-lr", "the floor of the decay", "the decay runs down from the peak"),
}


def _check_ratio(name: str, value: float) -> None:
    """``value`` must be a finite number in [0, 1]; a ``ValueError`` naming ``optimizer.schedule.<name>``."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"optimizer.schedule.{name}={value} must be a number in [0, 1] (a fraction of the peak lr, "
                         f"optimizer.logra.lr / optimizer.native.lr); e.g. optimizer.schedule.{name}=0.1")


@dataclass
class LRScheduleConfig:
    """Warmup and decay of every learning rate of the optimizer (``optimizer.schedule.*``; see the module
    docstring for the formula). The default (``constant``, no warmup) keeps each lr at its configured value."""

    warmup_steps: int = 0
    """Linear warmup over this many optimizer steps, from ``warmup_init_ratio`` × peak (or
    :attr:`warmup_init_lr`) to the peak (Megatron-LM ``--lr-warmup-iters``); 0: no warmup."""
    warmup_init_ratio: float = 0.0
    """The lr at the start of the warmup as a fraction of the peak, in [0, 1]. Give this or
    :attr:`warmup_init_lr`. Read only with ``warmup_steps > 0``."""
    warmup_init_lr: Optional[float] = None
    """The lr at the start of the warmup as an absolute lr (Megatron-LM ``--lr-warmup-init``, which sets it), or
    None (it is ``warmup_init_ratio`` × peak). It is the first warmup step's lr of the reference lr, the one
    ``--lr`` sets (the first of ``OptimizerConfig.scheduled_lrs``), exactly as given; every other scheduled lr
    starts at the same fraction ``warmup_init_lr / reference`` of its own peak, and the later warmup steps
    interpolate linearly to the peak. Must not exceed the reference lr; with it, leave ``warmup_init_ratio`` at 0.
    Read only with ``warmup_steps > 0``."""
    decay_style: str = "constant"
    """After the warmup: ``constant`` (the peak), ``linear``, ``cosine`` (to ``min_lr_ratio`` × peak at
    ``decay_steps``) or ``inverse-square-root`` (peak·sqrt(max(warmup_steps, 1)/step), floored at
    ``min_lr_ratio``) (Megatron-LM ``--lr-decay-style``)."""
    decay_steps: Optional[int] = None
    """Optimizer step at which the decay ends (the lr is ``min_lr_ratio`` × peak after it; Megatron-LM
    ``--lr-decay-iters``). None: the job's steps, ``train.steps`` (job=lm) or ``rl.steps`` (job=rl) -- raising
    those on resume then stretches the rest of the schedule; set it to pin the schedule. Must exceed
    ``warmup_steps`` for a decaying style."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of the peak, in [0, 1]. Give this or :attr:`min_lr`."""
    min_lr: Optional[float] = None
    """Floor of the decay as an absolute lr (Megatron-LM ``--min-lr``, which sets it), or None (the floor is
    ``min_lr_ratio`` × peak). It is the floor of the reference lr, the one ``--lr`` sets (the first of
    ``OptimizerConfig.scheduled_lrs``), exactly as given; every other scheduled lr decays to the same fraction
    ``min_lr / reference`` of its own peak. Must not exceed the reference lr; with it, leave ``min_lr_ratio``
    at 0."""

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optimizer.schedule.warmup_steps={self.warmup_steps!r} must be an integer >= 0 "
                             "(0: no warmup)")
        for name, ratio_name in ABSOLUTE_LRS.items():
            _check_ratio(ratio_name, getattr(self, ratio_name))
            value, ratio = getattr(self, name), getattr(self, ratio_name)
            if value is None:
                continue
            flag, role, _ = _ABSOLUTE_ROLES[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"optimizer.schedule.{name}={value!r} must be a finite lr >= 0 (the absolute lr of "
                                 f"{role}, {flag}), or null to use optimizer.schedule.{ratio_name}")
            if ratio != 0:
                raise ValueError(f"optimizer.schedule.{name}={value} and optimizer.schedule.{ratio_name}={ratio} "
                                 f"both set {role}; give one of them (set {ratio_name}=0 or {name}=null)")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"optimizer.schedule.decay_style={self.decay_style!r} is not supported; choose one of "
                             f"{', '.join(DECAY_STYLES)} (Megatron-LM's WSD is not offered)")
        if self.decay_steps is not None and (isinstance(self.decay_steps, bool) or not isinstance(self.decay_steps, int)
                                             or self.decay_steps < 1):
            raise ValueError(f"optimizer.schedule.decay_steps={self.decay_steps!r} must be an integer >= 1, or null "
                             "for the job's steps (train.steps / rl.steps)")
        if self.decays and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"optimizer.schedule.decay_steps={self.decay_steps} must exceed "
                             f"optimizer.schedule.warmup_steps={self.warmup_steps} with decay_style={self.decay_style}: "
                             f"the decay runs from the end of the warmup to decay_steps; raise decay_steps or lower "
                             f"warmup_steps")

    @property
    def decays(self) -> bool:
        """Whether the lr changes after the warmup (every style but ``constant``)."""
        return self.decay_style != "constant"

    @property
    def is_constant(self) -> bool:
        """True when every step's multiplier is 1 (``constant`` without warmup): each lr is its configured value."""
        return self.warmup_steps == 0 and not self.decays

    def fraction(self, name: str, reference_lr: Optional[float] = None) -> float:
        """The absolute lr ``name`` (a key of :data:`ABSOLUTE_LRS`) as a fraction of the peak: ``value /
        reference_lr`` when it is set (``reference_lr``: the lr ``--lr`` sets; 0 when it is 0), else the ratio
        field it replaces. ``ValueError`` when it is set and ``reference_lr`` is not given."""
        value = getattr(self, name)
        if value is None:
            return getattr(self, ABSOLUTE_LRS[name])
        if reference_lr is None:
            raise ValueError(f"optimizer.schedule.{name} is an absolute lr: the schedule needs the reference lr "
                             f"(the one --lr sets) to scale the others by")
        return float(value) / reference_lr if reference_lr else 0.0

    def floor_ratio(self, reference_lr: Optional[float] = None) -> float:
        """The floor of the decay as a fraction of the peak (:meth:`fraction` of :attr:`min_lr`)."""
        return self.fraction("min_lr", reference_lr)

    def check_peak(self, peak_field: str, peak: float) -> None:
        """``ValueError`` naming the fields when an absolute lr (:data:`ABSOLUTE_LRS`) exceeds ``peak``, the
        reference lr (``peak_field``, the one ``--lr`` sets)."""
        for name in ABSOLUTE_LRS:
            value = getattr(self, name)
            if value is not None and value > peak:
                flag, role, why = _ABSOLUTE_ROLES[name]
                raise ValueError(f"optimizer.schedule.{name}={value} exceeds the peak lr {peak_field}={peak} (--lr) "
                                 f"it is {role} of: {why}; lower optimizer.schedule.{name} ({flag}) or raise "
                                 f"{peak_field}")

    def resolve_decay_steps(self, total_steps: Optional[int], total_name: str = "the job's steps") -> int:
        """The decay's last step: ``decay_steps`` or, when None, ``total_steps`` (the job's optimizer steps,
        named ``total_name`` in errors). ``ValueError`` naming the fields when a decaying style has neither, or
        when ``total_steps`` does not exceed ``warmup_steps``. For ``constant`` the value is not read (0 when
        neither is known)."""
        if self.decay_steps is not None:
            return self.decay_steps
        if total_steps is None:
            if self.decays:
                raise ValueError(f"optimizer.schedule.decay_style={self.decay_style} needs the decay's length: set "
                                 f"optimizer.schedule.decay_steps, or pass the job's total steps")
            return 0
        if self.decays and total_steps <= self.warmup_steps:
            raise ValueError(f"optimizer.schedule.decay_steps=null decays over {total_name}={total_steps}, which "
                             f"must exceed optimizer.schedule.warmup_steps={self.warmup_steps} with decay_style="
                             f"{self.decay_style}; raise {total_name}, lower warmup_steps or set "
                             f"optimizer.schedule.decay_steps")
        return total_steps


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
