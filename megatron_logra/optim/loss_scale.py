"""Loss scaling for float16 training, as Megatron-LM's ``--fp16`` does it.

float16 holds nothing below about 6e-8: backward through a float16 model loses every activation gradient
smaller than that to zero. The loss is therefore multiplied by a scale ``s`` before backward (megatron-core's
``grad_scale_func``, set for the call by :func:`megatron_logra.train.step.forward_backward`), and the
optimizer divides the accumulated sketches and gradients (fp32) by ``s`` before it reads them. Too large an
``s`` overflows float16 to ``inf``: that step is skipped and, after ``hysteresis`` such steps in a row, ``s``
halves; ``window`` steps in a row without one double it. This is megatron-core's ``DynamicGradScaler``
(``--initial-loss-scale``, ``--min-loss-scale``, ``--loss-scale-window``, ``--hysteresis``) on plain Python
floats, so it needs no CUDA and its state is JSON; ``mode=static`` is Megatron-LM's ``--loss-scale``.

bfloat16 has float32's exponent range and needs none of this: ``mode=auto`` (the default) scales only a
model whose parameters are float16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

__all__ = ["LossScaleConfig", "LossScaler", "account_step", "build_loss_scaler", "restore_scaler", "scaler_fields",
           "skip_reason"]

MODES = ("auto", "dynamic", "static", "none")


@dataclass
class LossScaleConfig:
    """How the loss is scaled before backward (float16 training)."""

    mode: str = "auto"
    """auto: dynamic when the model's parameters are float16 (``model.params_dtype=float16``, ``--fp16``),
    none otherwise; dynamic: always (Megatron-LM's ``--fp16``); static: always ``initial``
    (``--loss-scale``); none: never (float16 gradients below about 6e-8 are then lost to zero)."""
    initial: float = 4096.0
    """The first scale of dynamic scaling (``--initial-loss-scale``), the scale of static scaling. The loss here
    is a sum over the step's tokens, so the gradient of each logit is up to its token's loss weight (1 for
    cross entropy, the advantage for RL) times the scale, and a scale near float16's largest value, 65504,
    overflows at once. Megatron-LM starts at 2**32 and skips the steps it takes to come down; this starts at
    2**12, 16 times below that limit."""
    min_scale: float = 1.0
    """Dynamic scaling never goes below this (``--min-loss-scale``); an overflow at this scale is a
    non-finite gradient like any other (the step is skipped and counts towards ``rl.max_bad_steps``)."""
    window: int = 1000
    """Dynamic: optimizer steps in a row without an overflow before the scale doubles (``--loss-scale-window``)."""
    hysteresis: int = 2
    """Dynamic: overflowing steps tolerated before the scale halves (``--hysteresis``); every overflowing
    step is skipped either way."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"optimizer.loss_scale.mode={self.mode!r} is unknown; choose one of {MODES}")
        for name in ("initial", "min_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"optimizer.loss_scale.{name}={value!r} must be a finite number > 0 "
                                 f"(a power of two keeps the scaling exact)")
        if self.min_scale > self.initial:
            raise ValueError(f"optimizer.loss_scale.min_scale={self.min_scale} is above optimizer.loss_scale.initial="
                             f"{self.initial}; lower min_scale or raise initial")
        for name in ("window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"optimizer.loss_scale.{name}={value!r} must be a whole number >= 1")

    def enabled_for(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether a model with ``params`` gets a scaler (``mode=auto``: any float16 parameter)."""
        if self.mode == "none":
            return False
        if self.mode == "auto":
            return any(p.dtype == torch.float16 for p in params)
        return True


class LossScaler:
    """The scale of the next backward and its update after each step (megatron-core's ``DynamicGradScaler``
    rules; a static scaler never changes). Pure Python state, the same on every rank: every rank sees the
    same overflow flag (reduced by the optimizer) and so takes the same decisions."""

    def __init__(self, cfg: LossScaleConfig) -> None:
        self.dynamic = cfg.mode != "static"
        self.scale = float(cfg.initial)
        self.min_scale = float(cfg.min_scale)
        self.window = cfg.window
        self.hysteresis = cfg.hysteresis
        self.growth_tracker = 0
        """Steps in a row without an overflow since the scale last changed."""
        self.hysteresis_tracker = cfg.hysteresis
        """Overflows left before the scale halves."""

    @property
    def at_minimum(self) -> bool:
        """An overflow now cannot be cured by a smaller scale (static scaling, or dynamic at ``min_scale``)."""
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        """Account one optimizer step: ``found_inf`` when its gradients overflowed (the step is skipped)."""
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        """JSON-ready state for checkpoints."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`. A static scaler keeps its configured scale (the flag given now
        wins); a dynamic one takes the saved scale, clamped to at least ``min_scale``."""
        if not self.dynamic:
            return
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"the checkpoint's loss scale {state['scale']!r} is not a finite number > 0")
        self.scale = max(scale, self.min_scale)
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


def build_loss_scaler(cfg: Optional[LossScaleConfig], params: Iterable[torch.Tensor]) -> Optional[LossScaler]:
    """The scaler ``cfg`` asks for given the model's ``params``; None when the loss is not scaled."""
    if cfg is None or not cfg.enabled_for(params):
        return None
    return LossScaler(cfg)


def account_step(scaler: Optional[LossScaler], found_inf: bool) -> bool:
    """Account an optimizer step whose non-finite flag (reduced over every rank that must agree) is ``found_inf``
    with ``scaler``; returns whether it is an overflow a smaller scale cures (``PreparedUpdate.overflow``): a
    non-finite value with the scale above its minimum. False without a scaler."""
    if scaler is None:
        return False
    overflow = found_inf and not scaler.at_minimum
    scaler.update(found_inf)
    return overflow


def skip_reason(update: Any, scaler: Optional[LossScaler], what: str = "non-finite sketch or gradient") -> str:
    """Why a step with a non-finite sketch or gradient (``what``) is skipped, after ``scaler.update`` took it into
    account: an overflow at a loss scale that comes down (``update.overflow``), or a non-finite value as such."""
    if scaler is None:
        return what
    if update.overflow:
        return (f"float16 overflow at loss scale {update.loss_scale:g} "
                f"(the next step runs at {scaler.scale:g})")
    kind = "static" if not scaler.dynamic else "minimum"
    return f"{what} at the {kind} loss scale {update.loss_scale:g}"


def scaler_fields(scaler: Optional[LossScaler]) -> dict:
    """An optimizer checkpoint's ``loss_scale`` entry (nothing when the loss is not scaled)."""
    return {"loss_scale": scaler.state_dict()} if scaler is not None else {}


def restore_scaler(scaler: Optional[LossScaler], state: dict) -> None:
    """Continue ``scaler`` from a checkpoint's :func:`scaler_fields`. A checkpoint without them (an unscaled
    run, or one saved before loss scaling existed) leaves the configured start; a saved scale is ignored
    when this run does not scale."""
    if scaler is not None and state.get("loss_scale") is not None:
        scaler.load_state_dict(state["loss_scale"])
