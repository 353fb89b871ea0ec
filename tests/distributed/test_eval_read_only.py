"""``megatron-logra eval RUN`` under torchrun of an RL run whose directory cannot be written (a read-only mount of a
finished run): evaluation only reads, so it gives the held-out accuracy the one-process ``eval`` gives. It used to
be refused by the shared-storage check, which writes a probe file into the run directory on every rank."""

from __future__ import annotations

import json

import pytest

from support.read_only import read_only

pytestmark = pytest.mark.distributed


def _result(proc) -> dict:
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def test_a_read_only_rl_run_is_evaluated_at_dp2(launcher, tmp_path):
    run = tmp_path / "run"
    launcher.launch(1, ["-m", "megatron_logra.cli", "train", "tiny", f"train.run_dir={run}", "rl.steps=1",
                        "rl.eval_interval=0", "task.num_eval=8", "train.progress=false"], timeout=240)
    with read_only(run):
        one = _result(launcher.launch(1, ["-m", "megatron_logra.cli", "eval", str(run)], timeout=240))
        proc = launcher.launch(2, ["-m", "megatron_logra.cli", "eval", str(run)], timeout=240, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    two = _result(proc)
    assert two["step"] == one["step"] == 1
    assert two["eval_accuracy"] == one["eval_accuracy"]
