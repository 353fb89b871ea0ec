"""NaN and ±inf in optimizer and KL-controller settings are refused naming the field (they pass every
``x < 0`` check: ``clip_grad=nan`` silently disabled clipping, ``lr=nan`` made every weight NaN), and so is
a decoupled weight decay whose per-step factor ``1 − lr·weight_decay`` would zero or flip the weights."""

from __future__ import annotations

import pytest

from megatron_logra.kl.controller import KLConfig
from megatron_logra.optim import LograConfig, NativeConfig

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("cls, section, field", [
    (LograConfig, "logra", "lr"),
    (LograConfig, "logra", "weight_decay"),
    (LograConfig, "logra", "eps"),
    (LograConfig, "logra", "clip_grad"),
    (LograConfig, "logra", "update_ratio"),
    (NativeConfig, "native", "lr"),
    (NativeConfig, "native", "weight_decay"),
    (NativeConfig, "native", "eps"),
    (KLConfig, "kl", "budget_start"),
    (KLConfig, "kl", "budget_end"),
    (KLConfig, "kl", "alpha_max"),
    (KLConfig, "kl", "calibration_clip"),
    (KLConfig, "kl", "fd_step"),
])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_non_finite_values_are_refused_naming_the_field(cls, section, field, value):
    with pytest.raises(ValueError, match=rf"^{section}\.{field}=(nan|inf|-inf) must be a finite number"):
        cls(**{field: value})


def test_native_weight_decay_must_not_be_negative():
    with pytest.raises(ValueError, match=r"native\.weight_decay=-0\.1 must be a finite number >= 0"):
        NativeConfig(weight_decay=-0.1)


@pytest.mark.parametrize("cls, section", [(LograConfig, "logra"), (NativeConfig, "native")])
@pytest.mark.parametrize("lr, weight_decay", [(1.0, 3.0), (0.5, 2.0), (1e-2, 150.0)])
def test_a_decay_factor_at_or_below_zero_is_refused(cls, section, lr, weight_decay):
    with pytest.raises(ValueError, match=rf"{section}\.lr × {section}\.weight_decay = .* must be < 1: .* "
                                         rf"lower {section}\.weight_decay"):
        cls(lr=lr, weight_decay=weight_decay)


@pytest.mark.parametrize("cls, values", [
    (LograConfig, dict(lr=1e-2, weight_decay=0.1, clip_grad=0.0)),
    (LograConfig, dict(lr=0.5, weight_decay=1.999)),  # decay factor 1 - lr·wd = 0.0005: still > 0
    (NativeConfig, dict(lr=1e-3, weight_decay=0.1)),
    (NativeConfig, dict(weight_decay=0.0)),
    (KLConfig, dict(fd_step=0.0, calibration_clip=1.0)),
    # the paper recipe applies neither lr nor weight decay to targets: their product is not checked there
    (LograConfig, dict(recipe="paper", lr=1.0, weight_decay=2.0)),
])
def test_usual_and_boundary_values_are_accepted_unchanged(cls, values):
    cfg = cls(**values)
    held = {k: getattr(cfg, k) for k in values}
    assert held == values and all(type(held[k]) is type(v) for k, v in values.items()), held
