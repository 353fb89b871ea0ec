"""A float16 run is told at start that it trains without loss scaling (Megatron-LM's ``--fp16`` always scales the
loss; this trainer has no scaler), by ``train`` and ``config`` alike; bfloat16 and float32 runs are not."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.cli import main


@pytest.mark.parametrize("args, warned", [(["--fp16"], True), (["model.params_dtype=float16"], True),
                                          (["--bf16"], False), ([], False)])
def test_float16_is_warned_about_loss_scaling(args, warned, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.cli.train"):
        assert main(["config", "lm-tiny", *args]) == 0
    capsys.readouterr()
    lines = [r.getMessage() for r in caplog.records if "loss scaling" in r.getMessage()]
    assert len(lines) == int(warned), lines
    if warned:
        assert "--bf16" in lines[0] and "6e-8" in lines[0]


def test_the_stated_limit_is_float16s():
    """The warning's "about 6e-8" is float16's smallest subnormal: half of it rounds to zero."""
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0 ** -10
    assert abs(tiny - 6e-8) / 6e-8 < 0.01
    assert torch.tensor(tiny, dtype=torch.float16).item() > 0
    assert torch.tensor(tiny / 2, dtype=torch.float16).item() == 0
