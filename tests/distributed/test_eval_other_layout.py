"""``megatron-logra eval RUN`` of a run trained at TP2, in one process without any layout flag: the saved layout
is lowered to one that fits (TP1), the checkpoint is resharded without a warning (nothing is continued), and the
held-out loss is the one the TP2 run measured at the same step."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


def test_a_tp2_run_evaluates_in_one_process(launcher, tmp_path):
    run = tmp_path / "run"
    launcher.launch(2, ["-m", "megatron_logra.cli", "train", "lm-tiny", f"train.run_dir={run}", "train.steps=2",
                        "--tensor-model-parallel-size", "2", "model.hidden_dropout=0.0", "train.progress=false"],
                    timeout=240)
    trained = json.loads((run / "summary.json").read_text())
    proc = launcher.launch(1, ["-m", "megatron_logra.cli", "eval", str(run)], timeout=240)
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["step"] == 2
    assert result["eval_loss"] == pytest.approx(trained["eval_loss_after"], rel=1e-5)
    assert "evaluating at tp=1 × pp=1" in proc.stderr
    assert "weights are resharded" in proc.stderr and "RNG states start fresh" not in proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
