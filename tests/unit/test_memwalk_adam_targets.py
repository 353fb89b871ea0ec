"""``--targets`` sets what only a LoGRA plan has; with ``--optimizer adam`` alone it used to be accepted and
silently ignored (the dense plan trains every parameter alike), unlike the other LoGRA-only flags."""

from __future__ import annotations

import pytest

from megatron_logra.memory.cli import main
from megatron_logra.memory.planner import plan
from megatron_logra.models.presets import get_preset


def test_targets_with_dense_adamw_alone_is_one_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen2.5-1.5b", "--optimizer", "adam", "--targets", "linear_qkv"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--targets" in err and "LoGRA only" in err and "--compare" in err
    assert "Traceback" not in err


def test_the_dense_plan_does_not_depend_on_targets():
    """Why the flag is refused: the dense AdamW plan of 1.5B at TP 1 is 18 B per parameter of persistent state
    (2 B weights + 4 grads + 4 masters + 8 moments per 16-bit parameter, 4 + 4 + 8 per fp32 norm weight),
    whatever the targets, with Qwen2.5-1.5B's published shape counted here."""
    h, a, g, d, f, V, L = 1536, 12, 2, 128, 8960, 151936, 28
    qkv = (a + 2 * g) * d
    n16 = L * (qkv * h + qkv + h * a * d + 3 * f * h) + V * h
    n32 = L * 2 * h + h
    model = get_preset("qwen2.5-1.5b")
    for targets in (("linear_qkv",), ("linear_fc1", "linear_fc2")):
        w = plan(model, optimizer="adam", targets=targets, seq_len=512).worst
        assert w.persistent == 18 * n16 + 16 * n32


def test_targets_with_compare_still_plans_logra_beside_dense(capsys):
    assert main(["--model", "qwen2.5-1.5b", "--optimizer", "adam", "--compare", "--targets", "linear_qkv",
                 "--seq-len", "512", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "dense AdamW" in out and "LoGRA r=" in out
