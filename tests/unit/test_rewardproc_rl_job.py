"""``task.reward_workers=2`` in a whole RL job (the tiny recipe, shrunk as in ``test_rl_e2e``): the same records
and the same per-sample rewards as scoring in process, the workers really scored, and none is left once the job
has returned. CPU, real components, no mocks."""

from __future__ import annotations

import json
import logging
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

TIMING = ("seconds", "per_second", "memory", "gpu_")
"""Record fields that measure the machine, not the run."""


def _run(run_dir: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl

    cfg = parse_args_to_config("tiny", [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "logra.recipe=paper",
        "logra.update_ratio=2e-3", "sft.steps=20", "sft.init_path=", "tokenizer.path=", "sft.cache=false",
        "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=16", "rl.log_samples=16",
        "task.num_eval=8", "rl.eval_interval=0", f"train.run_dir={run_dir}", "train.progress=false", *extra])
    destroy_parallel()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert run_rl(cfg)["steps"] == 2
    finally:
        destroy_parallel()
    records = [{k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    return records, samples


def test_an_rl_job_scoring_in_workers_matches_the_in_process_job(tmp_path, caplog):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: intra-op threads only add contention
    try:
        records, samples = _run(tmp_path / "in_process")
        with caplog.at_level(logging.INFO, logger="megatron_logra.rewards.process_pool"):
            records_w, samples_w = _run(tmp_path / "workers", "task.reward_workers=2")
    finally:
        torch.set_num_threads(before)
    assert any("scoring rewards in 2 worker processes" in r.getMessage() for r in caplog.records)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("reward-worker")]
    assert [r["step"] for r in records] == [1, 2] and records_w == records
    rewards = [s["reward"] for s in samples if "reward" in s]
    assert len(rewards) >= 16 and len(set(rewards)) >= 2  # graded rewards: a real comparison
    assert samples_w == samples  # every logged sample's exact reward, the held-out ones' too
