"""Typed configs of the optimizers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_logra.optim.loss_scale import LossScaleConfig
from megatron_logra.optim.schedule import LRScheduleConfig
from megatron_logra.sketch.capture import DEFAULT_TARGETS
from megatron_logra.sketch.naming import TARGET_ALIASES
from megatron_logra.sketch.random_projection import DISTRIBUTIONS

__all__ = ["LograConfig", "LossScaleConfig", "NativeConfig", "OptimizerConfig", "LRScheduleConfig"]


def _check_number(name: str, value: float, *, positive: bool) -> None:
    """``value`` must be a finite number > 0 (``positive``) or >= 0; a ``ValueError`` naming ``name``
    otherwise (NaN and ±inf pass every ``<`` comparison, so they are checked first)."""
    bound = "> 0" if positive else ">= 0"
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value} must be a finite number {bound}")


def _check_decay(section: str, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay multiplies the weights by ``1 − lr·weight_decay`` each step: at or
    below 0 it zeroes or flips them."""
    if lr * weight_decay >= 1.0:
        raise ValueError(
            f"{section}.lr × {section}.weight_decay = {lr} × {weight_decay} = {lr * weight_decay:g} must be < 1: "
            f"each step multiplies the weights by 1 − lr·weight_decay, which would zero or flip them; lower "
            f"{section}.weight_decay (typical: 0.01–0.1) or {section}.lr"
        )


@dataclass
class NativeConfig:
    """AdamW for parameters that are not LoGRA targets (embeddings, norms, biases, output layer)."""

    freeze: bool = False
    """Freeze non-target parameters instead of training them."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (>= 0; ``lr · weight_decay < 1``)."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""

    def __post_init__(self) -> None:
        _check_number("native.lr", self.lr, positive=False)
        _check_number("native.weight_decay", self.weight_decay, positive=False)
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"native.beta1={self.beta1} must lie in [0, 1)")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"native.beta2={self.beta2} must lie in [0, 1)")
        _check_number("native.eps", self.eps, positive=True)
        _check_decay("native", self.lr, self.weight_decay)


@dataclass
class LograConfig:
    """LoGRA sketch optimizer (DESIGN §1)."""

    rank: int = 256
    """Sketch rank r (1 <= r <= n_in of every target)."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Target layers: Megatron kinds (linear_qkv, linear_proj, linear_fc1, linear_fc2), HF/SGLang aliases that
    select a kind (``sketch.naming.TARGET_ALIASES``: q_proj, k_proj, v_proj and qkv_proj select linear_qkv, the
    whole fused QKV weight; o_proj selects linear_proj; gate_proj, up_proj and gate_up_proj select linear_fc1,
    the whole fused gate+up weight; down_proj selects linear_fc2), or exact leaf module names (output_layer).
    A name that matches no module of the model is refused when the sketches are installed."""
    distribution: str = "rademacher"
    """Projection entries: rademacher (±1/√r) or gaussian (N(0, 1/r))."""
    refresh: bool = True
    """Redraw the projection every optimizer step (update index = step − 1)."""
    seed: int = 1234
    """Base seed of the projections."""
    algorithm: str = "row_adam"
    """row_adam (per-row second moment) or sgd (D = S)."""
    recipe: str = "optimizer"
    """optimizer: lr / weight decay / clipping. paper: token-normalised sketches, per-layer
    norm restoration, global update-ratio scaling, step size α from the KL controller."""
    lr: float = 1e-3
    """Learning rate (optimizer recipe)."""
    weight_decay: float = 0.0
    """Decoupled weight decay on targets (optimizer recipe; >= 0, ``lr · weight_decay < 1``). Applied in
    full whatever the step size α, and not part of the predicted KL (its change is ``lr·wd`` relative)."""
    beta2: float = 0.95
    """RowAdam second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """RowAdam denominator epsilon."""
    clip_grad: float = 1.0
    """Global-norm clip of the reconstructed gradient plus native grads; 0 disables (optimizer recipe)."""
    update_ratio: float = 6e-5
    """‖ΔW‖_F / ‖W‖_F over all targets at α = 1 (paper recipe)."""
    masters: str = "fp32"
    """fp32: fp32 master copy of low-precision targets (≈6 B/param); none: bf16-only (≈2 B/param)."""
    rounding: str = "stochastic"
    """Rounding of bf16 weights in bf16-only updates and in every sketch-delta merge (trainer and engines alike,
    ``sync.apply``): stochastic (counter-based noise, unbiased) or nearest."""
    scale_native: bool = True
    """Scale the native AdamW part of a step (non-target parameters, when trained) by the step size
    α as well, so a KL controller limits the whole update; False applies native steps in full."""
    cache_projections: bool = True
    """Keep a step's projections (fp32, Σ r·n_in·4 bytes) until the step is applied instead of
    regenerating them per micro-batch and for the update."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"logra.rank={self.rank} must be >= 1")
        if not self.targets:
            raise ValueError("logra.targets is empty; name at least one target layer (e.g. linear_qkv)")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"logra.distribution={self.distribution!r} is unknown; choose one of {DISTRIBUTIONS}")
        if self.algorithm not in ("row_adam", "sgd"):
            raise ValueError(f"logra.algorithm={self.algorithm!r}: choose row_adam or sgd")
        if self.recipe not in ("optimizer", "paper"):
            raise ValueError(f"logra.recipe={self.recipe!r}: choose optimizer or paper")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"logra.beta2={self.beta2} must lie in [0, 1)")
        _check_number("logra.eps", self.eps, positive=True)
        _check_number("logra.lr", self.lr, positive=False)
        _check_number("logra.weight_decay", self.weight_decay, positive=False)
        if not (math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            raise ValueError(f"logra.clip_grad={self.clip_grad} must be a finite number >= 0 (0 disables clipping)")
        _check_number("logra.update_ratio", self.update_ratio, positive=True)
        if self.recipe == "optimizer":  # the paper recipe applies no lr and no weight decay to targets
            _check_decay("logra", self.lr, self.weight_decay)
        if self.masters not in ("fp32", "none"):
            raise ValueError(f"logra.masters={self.masters!r}: choose fp32 or none (bf16-only)")
        if self.rounding not in ("stochastic", "nearest"):
            raise ValueError(f"logra.rounding={self.rounding!r}: choose stochastic or nearest")
        unknown = [t for t in self.targets if not t.replace("_", "").isalnum()]
        if unknown:
            raise ValueError(f"logra.targets has malformed names {unknown}; known names: {sorted(TARGET_ALIASES)}")


@dataclass
class OptimizerConfig:
    """Which optimizer trains the model."""

    name: str = "logra"
    """logra (sketches for targets + native AdamW) or adam (dense AdamW, for comparison)."""
    logra: LograConfig = field(default_factory=LograConfig)
    """LoGRA settings."""
    native: NativeConfig = field(default_factory=NativeConfig)
    """AdamW for non-targets (and for everything when name=adam)."""
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Warmup and decay of every lr above (``optim/schedule.py``): ``logra.lr`` (optimizer recipe: update
    scale and weight decay) and ``native.lr``; the paper recipe's targets follow the KL controller, not it."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Loss scaling of float16 models (``optim/loss_scale.py``; dynamic by default for ``--fp16``, off for
    bfloat16 and float32)."""

    def __post_init__(self) -> None:
        if self.name not in ("logra", "adam"):
            raise ValueError(f"optimizer.name={self.name!r}: choose logra or adam")
        if not self.schedule.is_constant and not self.scheduled_lrs():
            raise ValueError(
                f"optimizer.schedule (warmup_steps={self.schedule.warmup_steps}, decay_style="
                f"{self.schedule.decay_style}) changes nothing here: optimizer.logra.recipe=paper has no lr for the "
                f"targets (their step follows the KL controller) and optimizer.native.freeze=true trains no other "
                f"parameter; drop the schedule, set optimizer.native.freeze=false or use optimizer.logra.recipe=optimizer")
        lrs = self.scheduled_lrs()
        if lrs:  # the absolute lrs (min_lr, warmup_init_lr) are of the first: none may exceed it
            self.schedule.check_peak(*next(iter(lrs.items())))

    def scheduled_lrs(self) -> dict[str, float]:
        """The configured (peak) lrs that :attr:`schedule` multiplies, by dotted field, the first being the one
        Megatron-LM's ``--lr`` sets (``--lr-warmup-init`` its exact initial warmup lr, ``--min-lr`` its exact floor):
        ``optimizer.logra.lr`` (LoGRA's optimizer recipe) then ``optimizer.native.lr`` unless the non-targets
        are frozen; dense AdamW: ``optimizer.native.lr``. Empty when nothing follows a schedule (paper recipe
        with frozen non-targets)."""
        if self.name == "adam":
            return {"optimizer.native.lr": self.native.lr}
        out = {"optimizer.logra.lr": self.logra.lr} if self.logra.recipe == "optimizer" else {}
        if not self.native.freeze:
            out["optimizer.native.lr"] = self.native.lr
        return out
