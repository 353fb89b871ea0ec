"""``--advantage-estimator`` given twice takes its last value, as a repeated key does (and as slime's argparse
does): each of its values sets another field (``grpo`` ``rl.advantage.estimator``, ``gspo`` ``rl.loss.kind``,
``reinforce_plus_plus_baseline`` ``rl.advantage.scale_by_std``), and an earlier value's field must not survive a
later value. The reference is the config of the last value given alone."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config

VALUES = ["grpo", "gspo", "reinforce_plus_plus_baseline"]
EXTRA = ["--normalize-advantages"]  # reinforce_plus_plus_baseline needs it; the same for every line


def _summary(args: list[str]) -> tuple:
    cfg = parse_args_to_config("tiny", args + EXTRA)
    a = cfg.rl.advantage
    return a.estimator, a.scale_by_std, a.normalize, a.baseline, cfg.rl.loss.kind


@pytest.mark.parametrize("first", VALUES)
@pytest.mark.parametrize("last", VALUES)
def test_the_last_value_wins(first, last):
    alone = _summary(["--advantage-estimator", last])
    assert _summary(["--advantage-estimator", first, "--advantage-estimator", last]) == alone
    assert _summary(["--advantage-estimator", first, "rl.steps=2", f"--advantage-estimator={last}"]) == alone
