"""The predicted-KL controller under pipeline parallelism (2 stages).

Forward-mode tangents cannot cross stages, so ``kl.probe=auto`` takes the finite-difference probe
there: every stage perturbs its own targets inside megatron's forward-only schedule and the last
stage computes the prediction and the measured KL. Reference: the same RL job in one process with
``kl.probe=finite_difference`` (same seeds, DP = 1 in both), whose first update sees the same
weights and rollouts: α (a function of the prediction) and the measured KL must agree to float
rounding of a different stage split. ``kl.alpha_max`` is raised so α is not capped.

Both runs also carry a KL penalty to the reference policy (``rl.loss.kl_coef``): under PP the
reference model runs its own forward-only pipeline schedule and only the last stage holds its
log-probs. Its measured KL to the policy (``ref_kl``) is exactly 0 on the first update (the policy
is the reference) and must agree with the one-process run's on the second.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.distributed

COMMON = ["rl.steps=2", "kl.mode=calibrated", "kl.alpha_max=1000", "train.progress=false", "rl.prompts_per_step=4",
          "rl.group_size=4", "rl.eval_interval=0", "task.num_eval=8", "sync.check_interval=1",
          "rl.loss.kl_coef=0.05"]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_kl_control_with_two_pipeline_stages_matches_one_process(launcher, tmp_path):
    pp_run, ref_run = tmp_path / "pp2", tmp_path / "pp1"
    with ThreadPoolExecutor(1) as pool:  # the two runs are independent: side by side
        ref_launch = pool.submit(launcher.launch, 1, ["-m", "megatron_logra.cli", "train", "tiny",
                                                      "kl.probe=finite_difference", f"train.run_dir={ref_run}",
                                                      *COMMON], timeout=500, log=tmp_path / "pp1.log")
        launcher.launch(2, ["-m", "megatron_logra.cli", "train", "tiny", "--pipeline-model-parallel-size", "2",
                            f"train.run_dir={pp_run}", *COMMON], timeout=500, log=tmp_path / "pp2.log")
        ref_launch.result()
    pp, ref = _records(pp_run), _records(ref_run)
    assert [r["step"] for r in pp] == [r["step"] for r in ref] == [1, 2]
    for got, want in zip(pp, ref):
        assert got["reward_mean"] == want["reward_mean"]  # the same rollouts
        assert 0 < got["alpha"] < 1000  # not capped: α = sqrt(budget / (c·pred)) carries the prediction
        assert got["alpha"] == pytest.approx(want["alpha"], rel=1e-4)
        assert got["kl_predicted"] == pytest.approx(want["kl_predicted"], rel=1e-4)
        assert got["kl_actual"] > 0 and got["kl_actual"] == pytest.approx(want["kl_actual"], rel=1e-3)
        assert (got["sync_mode"], got["sync_drift"]) == ("delta", 0)
    assert pp[0]["ref_kl"] == ref[0]["ref_kl"] == 0.0
    assert pp[1]["ref_kl"] > 0 and pp[1]["ref_kl"] == pytest.approx(ref[1]["ref_kl"], rel=1e-3)
    # measured here: both updates came out bitwise equal (α 1.166 and 32.03)
