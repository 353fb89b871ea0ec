"""``rl.log_samples`` under data parallelism (2 ranks, gloo, ``megatron-logra train``): only global rank 0 writes
``samples.jsonl``, each record once, with DP rank 0's share of the step (``rl.prompts_per_step / DP`` prompts'
groups) and of the held-out set; pass@k over several held-out samples counts both ranks' problems."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytestmark = pytest.mark.distributed


def test_only_rank_0_logs_its_share(launcher, tmp_path):
    run = tmp_path / "run"
    launcher.launch(2, ["-m", "megatron_logra.cli", "train", "tiny", f"train.run_dir={run}", "rl.steps=2",
                        "rl.prompts_per_step=4", "rl.group_size=2", "rl.micro_batch_size=8", "task.num_eval=8",
                        "rl.eval_interval=0", "rl.log_samples=16", "rl.rollout.eval_samples=2",
                        "rl.rollout.eval_temperature=1.0", "train.save_interval=0", "train.progress=false",
                        "parallel.timeout_minutes=2"], timeout=240)
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    counts = Counter((r["step"], r["split"]) for r in records)
    # rank 0's batch: 2 prompts x 2 samples; its half of the held-out set: 4 problems x 2 samples, before and after
    assert counts == {(1, "train"): 4, (2, "train"): 4, (0, "eval"): 8, (2, "eval"): 8}
    summary = json.loads((run / "summary.json").read_text())
    final = [r for r in records if r["split"] == "eval" and r["step"] == 2]
    solved_here = len({r["prompt"] for r in final if r["correct"]})
    # pass@k is over all 8 problems: rank 0's solved ones are a part of it, rank 1's the rest
    assert solved_here / 8 <= summary["eval_pass_at_k_after"] <= (solved_here + 4) / 8
