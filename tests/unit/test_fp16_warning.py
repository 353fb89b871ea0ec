"""A float16 run whose loss scaling is turned off (``optimizer.loss_scale.mode=none``) is told at start that it
trains without it, by ``train`` and ``config`` alike; a float16 run with the default (dynamic) scaling, and
bfloat16 and float32 runs, are not."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.cli import main


@pytest.mark.parametrize("args, warned", [(["--fp16", "optimizer.loss_scale.mode=none"], True),
                                          (["model.params_dtype=float16", "optimizer.loss_scale.mode=none"], True),
                                          (["--fp16"], False), (["--fp16", "--loss-scale", "1024"], False),
                                          (["--bf16", "optimizer.loss_scale.mode=none"], False), ([], False)])
def test_float16_is_warned_about_loss_scaling(args, warned, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.cli.train"):
        assert main(["config", "lm-tiny", *args]) == 0
    capsys.readouterr()
    lines = [r.getMessage() for r in caplog.records if "loss scaling" in r.getMessage()]
    assert len(lines) == int(warned), lines
    if warned:
        assert "--bf16" in lines[0] and "6e-8" in lines[0] and "optimizer.loss_scale.mode=none" in lines[0]


def test_the_stated_limit_is_float16s():
    """The warning's "about 6e-8" is float16's smallest subnormal: half of it rounds to zero."""
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0 ** -10
    assert abs(tiny - 6e-8) / 6e-8 < 0.01
    assert torch.tensor(tiny, dtype=torch.float16).item() > 0
    assert torch.tensor(tiny / 2, dtype=torch.float16).item() == 0
