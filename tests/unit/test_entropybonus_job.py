"""The ``tiny`` RL job with an entropy bonus (``rl.loss.entropy_coef=0.01``): it trains (updates applied, finite
losses), logs the policy's ``entropy`` per step, and a step of uniform groups is not skipped, since the bonus
still pulls (as with a KL penalty)."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

STEPS = ["rl.steps=2", "train.progress=false", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=16",
         "rl.eval_interval=0", "task.num_eval=0", "train.save_interval=0"]


def test_tiny_job_trains_with_the_bonus_and_logs_the_entropy(tmp_path, one_thread):
    from support.run_fixtures import run_rl_recipe

    run = tmp_path / "run"
    summary = run_rl_recipe("tiny", [f"train.run_dir={run}", "rl.loss.entropy_coef=0.01", *STEPS])
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "entropy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        if r["skipped"]:  # a refused update (non-finite) would be a bug here; zero advantages cannot skip
            pytest.fail(f"step {r['step']} skipped: {r['skip_reason']}")
        # the entropy of the sampling distribution per loss token, in nats: above 0, at most log V (V = 160)
        assert 0.0 < r["entropy"] <= math.log(160) and math.isfinite(r["loss"]), r
        assert r["alpha"] is not None


def test_uniform_groups_still_train_with_the_bonus(tmp_path, monkeypatch):
    """Every reward equal (all advantages 0): with ``entropy_coef=0`` the step applies nothing; with the bonus
    the loss is ``−c·ΣH`` alone and the update is applied."""
    import torch

    from megatron_logra.rl.loop import rl_update
    from support.run_fixtures import rl_components

    with rl_components(tmp_path / "run", ["rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4",
                                          "task.num_eval=0", "rl.loss.entropy_coef=0.01"]) as (comps, state):
        monkeypatch.setattr(comps.task, "score", lambda problem, completion: (0.0, False))
        params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
        record = rl_update(comps, state)
        assert not record["skipped"] and record["groups_uniform"] == 2, record
        assert record["entropy"] > 0.0 and record["loss"] == pytest.approx(-0.01 * record["entropy"], rel=1e-4)
        assert any(not torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())
        comps.cfg.rl.loss.entropy_coef = 0.0  # the same components without the bonus: the step is skipped
        record = rl_update(comps, state)
        assert record["skipped"] and record["skip_reason"] == "zero advantages"
