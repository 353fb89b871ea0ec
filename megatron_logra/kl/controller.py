"""Predicted-KL step-size control (DESIGN §1).

Given ``pred`` — the second-order prediction of ``KL(π_old ‖ π_new)`` for the full step
``ΔW = −D·A`` (α = 1) — the step size is ``α = min(α_max, sqrt(budget_eff / (c·pred)))``:

* ``budget``: cosine from ``budget_start`` to ``budget_end`` over ``horizon`` updates;
* mismatch: ``m = max(0, mean(rollout_logprob − trainer_logprob))`` over completed sequences,
  ``M ← ρ·M + (1−ρ)·m`` and ``budget_eff = max(budget − M, ½·budget)``;
* calibration (closed loop): after the step, the actual KL on the probe set is measured and
  ``c ← ρ_c·c + (1−ρ_c)·actual / (α²·pred)`` corrects the quadratic model's bias.

A non-finite or negative prediction, or zero valid positions, is an error: a controlled run
never takes an uncontrolled step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KLConfig", "KLController", "KLControlError", "cosine_budget"]


class KLControlError(RuntimeError):
    """The KL prediction cannot be trusted; the step must not be taken."""


PROBE_METHODS = ("auto", "jvp", "finite_difference")
"""Values of ``kl.probe``."""


@dataclass
class KLConfig:
    """Step-size control by predicted KL."""

    mode: str = "predicted"
    """predicted (α from the probe), calibrated (predicted + closed-loop correction by the
    measured KL) or none (α = 1: the optimizer's own scale)."""
    budget_start: float = 2e-4
    """KL budget per update at the first update (b0)."""
    budget_end: float = 2e-5
    """KL budget per update after ``horizon`` updates (bf)."""
    horizon: int = 300
    """Updates over which the budget follows a cosine from start to end (H)."""
    alpha_max: float = 3.0
    """Largest allowed step size α (also when the predicted KL is 0, where α would be 1)."""
    mismatch_decay: float = 0.7
    """EMA weight ρ of the old mismatch: M ← ρ·M + (1−ρ)·m."""
    calibration_decay: float = 0.7
    """EMA weight of the old calibration factor c."""
    calibration_clip: float = 10.0
    """Each observed actual/predicted ratio is clipped to [1/clip, clip] before the EMA."""
    probe_sequences: int = 2
    """Probe sequences per data-parallel rank."""
    probe_max_tokens: int = 4096
    """Token cap of the probe set per rank."""
    measure_actual: bool = True
    """Measure the actual KL on the probe set after each step (needed by ``calibrated``)."""
    probe: str = "auto"
    """How the prediction gets the logits' tangent: jvp (one forward-mode AD pass), finite_difference
    (three no-grad forwards with the step added to the target outputs, five when trained non-targets take
    their own step; for kernels without forward-mode
    rules such as TransformerEngine / FP8) or auto (finite_difference when a target is a TE module)."""
    fd_step: float = 0.0
    """Central-difference step h of the finite-difference probe, in units of the α = 1 update; 0 = auto:
    h = max(1, fd_min_relative / (‖ΔW‖/‖W‖ at α = 1)) for low-precision targets, else 1; trained
    non-targets take their own h' by the same rule from their ‖Δθ‖/‖θ‖. A fixed value > 0 is used for both."""
    fd_min_relative: float = 0.005
    """Auto step: ‖h·ΔW‖/‖W‖ for bf16/fp16 targets, so the perturbation stands above the outputs' rounding
    (bf16 resolves ≈ 0.4% relative; the paper's α = 1 update is 6e-5). Larger steps bias the central
    difference by the policy's curvature (on a small GPT: −3% at 0.005, −17% at 0.02)."""

    def __post_init__(self) -> None:
        if self.mode not in ("predicted", "calibrated", "none"):
            raise ValueError(f"kl.mode={self.mode!r}: choose predicted, calibrated or none")
        # NaN and ±inf pass every `<` test: finiteness first (an infinite budget or α cap is an uncontrolled step)
        for name in ("budget_start", "budget_end", "alpha_max"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"kl.{name}={value} must be a finite number > 0")
        if self.horizon < 1:
            raise ValueError(f"kl.horizon={self.horizon} must be >= 1")
        for name in ("mismatch_decay", "calibration_decay"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"kl.{name}={getattr(self, name)} must lie in [0, 1)")
        if not (math.isfinite(self.calibration_clip) and self.calibration_clip >= 1.0):
            raise ValueError(f"kl.calibration_clip={self.calibration_clip} must be a finite number >= 1")
        if self.probe_sequences < 1 or self.probe_max_tokens < 1:
            raise ValueError("kl.probe_sequences and kl.probe_max_tokens must be >= 1")
        if self.probe not in PROBE_METHODS:
            raise ValueError(f"kl.probe={self.probe!r}: choose one of {PROBE_METHODS}")
        if not (math.isfinite(self.fd_step) and self.fd_step >= 0):
            raise ValueError(f"kl.fd_step={self.fd_step} must be a finite number >= 0 (0 chooses it from the "
                             "target dtype)")
        if not 0 < self.fd_min_relative < 1:
            raise ValueError(f"kl.fd_min_relative={self.fd_min_relative} must lie in (0, 1); 0.005 suits bf16")
        if self.mode == "calibrated" and not self.measure_actual:
            raise ValueError("kl.mode=calibrated needs kl.measure_actual=true")


def cosine_budget(update: int, start: float, end: float, horizon: int) -> float:
    """Budget of the ``update``-th update (1-based): cosine from ``start`` (update 1) to ``end``
    (update ``horizon + 1`` and later)."""
    progress = min(max(update - 1, 0), horizon) / horizon
    return end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * progress))


class KLController:
    """State and arithmetic of predicted-KL step control; checkpointed with the optimizer."""

    def __init__(self, cfg: KLConfig) -> None:
        self.cfg = cfg
        self.mismatch = 0.0
        self.calibration = 1.0
        self.num_updates = 0

    def budget(self, update: int) -> float:
        return cosine_budget(update, self.cfg.budget_start, self.cfg.budget_end, self.cfg.horizon)

    def observe_mismatch(self, mean_logprob_gap: float) -> float:
        """Fold in ``mean(rollout_logprob − trainer_logprob)`` of this step's completed sequences."""
        if not math.isfinite(mean_logprob_gap):
            raise KLControlError(f"rollout/trainer log-prob mismatch is not finite ({mean_logprob_gap})")
        m = max(0.0, mean_logprob_gap)
        rho = self.cfg.mismatch_decay
        self.mismatch = rho * self.mismatch + (1.0 - rho) * m
        return self.mismatch

    def effective_budget(self, update: int) -> float:
        budget = self.budget(update)
        return max(budget - self.mismatch, 0.5 * budget)

    def step_size(self, predicted: float, update: int) -> tuple[float, float]:
        """(α, budget_eff) for a step whose full (α = 1) predicted KL is ``predicted``:
        ``α = min(α_max, sqrt(budget_eff / (c·predicted)))`` (``c`` = 1 unless ``mode=calibrated``), and
        ``min(1, α_max)`` when ``predicted`` is 0; α is never above ``alpha_max``. ``mode=none``: α = 1.
        Raises :class:`KLControlError` for a non-finite or negative ``predicted``."""
        if self.cfg.mode == "none":
            return 1.0, self.effective_budget(update)
        if not math.isfinite(predicted) or predicted < 0:
            raise KLControlError(f"predicted KL {predicted!r} is not a finite non-negative number")
        budget_eff = self.effective_budget(update)
        if predicted == 0.0:  # the step changes no probed log-prob: the optimizer's own scale, within the cap
            return min(1.0, self.cfg.alpha_max), budget_eff
        c = self.calibration if self.cfg.mode == "calibrated" else 1.0
        alpha = min(self.cfg.alpha_max, math.sqrt(budget_eff / (c * predicted)))
        return alpha, budget_eff

    def observe_actual(self, actual: float, predicted_at_alpha: float) -> None:
        """Update the calibration factor from the KL measured after a step."""
        if not (math.isfinite(actual) and math.isfinite(predicted_at_alpha)) or predicted_at_alpha <= 0:
            return
        clip = self.cfg.calibration_clip
        ratio = min(max(max(actual, 0.0) / predicted_at_alpha, 1.0 / clip), clip)
        rho = self.cfg.calibration_decay
        self.calibration = rho * self.calibration + (1.0 - rho) * ratio

    def finish_update(self) -> None:
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {"mismatch": self.mismatch, "calibration": self.calibration, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.mismatch = float(state["mismatch"])
        self.calibration = float(state["calibration"])
        self.num_updates = int(state["num_updates"])
