"""A dense AdamW run (recipe ``tiny-adam``) is never KL-controlled: its metrics record α = 1 and no KL
budget (they logged the decaying budget of a controller that never sized a step, so the run looked
KL-controlled). One RL step through the real command line, in a subprocess (it builds a process group)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_dense_adamw_run_records_no_kl_budget(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "megatron_logra.cli", "train", "tiny-adam", "rl.steps=1",
                          "task.num_eval=8", f"train.run_dir={run}", "train.progress=false"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Megatron-FSDP" not in out.stderr  # megatron-core's FSDP import notices: FSDP is not used here
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step") == 1 and not r.get("skipped")]
    assert steps, records  # a real update, not a skipped step (which records no budget either)
    assert all(r["budget"] is None and r["alpha"] == 1.0 and r["kl_predicted"] is None for r in steps)
