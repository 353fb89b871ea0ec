"""Dynamic sampling under data parallelism, as a cluster user launches it (2 ranks, gloo, ``megatron-logra
train``): when only rank 0's batch holds groups of equal rewards, both ranks run the extra round together (the
engines and the reward's collectives stay in step; nothing waits for a peer that never comes), rank 0 replaces
its groups, and the step's record counts them over both ranks."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


def test_an_extra_round_needed_on_one_rank_runs_on_both(launcher, tmp_path):
    run = tmp_path / "run"
    launcher.launch(2, ["-m", "megatron_logra.cli", "train", "tiny", f"train.run_dir={run}", "rl.steps=2",
                        "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=16", "task.num_eval=0",
                        "rl.eval_interval=0", "rl.dynamic_sampling_rounds=2", "train.save_interval=0",
                        "train.progress=false", "parallel.timeout_minutes=2",
                        "task.reward=support.rank_reward:first_round_uniform_on_rank0"], timeout=240)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    # step 1: rank 0's two groups were uniform; one extra round on both ranks replaced them
    assert (first["resample_rounds"], first["groups_resampled"], first["groups_uniform"]) == (1, 2, 0)
    # every rollout generated: 2 ranks × 2 rounds × 2 prompts × 4; rank 0's 8 first scores 0, all others half correct
    assert first["accuracy"] == pytest.approx((32 - 8) / 2 / 32)
    assert not first["skipped"]
    assert (second["resample_rounds"], second["groups_resampled"], second["groups_uniform"]) == (0, 0, 0)
    assert second["accuracy"] == pytest.approx(0.5)
