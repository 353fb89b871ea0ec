"""The learning-rate schedule's section (``optimizer.schedule``): its fields, and the values it refuses.

Owns :class:`LRScheduleConfig` (warmup, decay style and length, the floor and the start of the warmup, as
fractions of the peak or as absolute lrs), the accepted decay styles (:data:`DECAY_STYLES`) and the absolute lrs
and the ratio each replaces (:data:`ABSOLUTE_LRS`), with every check a config gets before a step is taken (a
``ValueError`` naming the field). What the schedule computes from it, step by step, is
:mod:`megatron_logra.optim.schedule`, from which these names stay importable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


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
