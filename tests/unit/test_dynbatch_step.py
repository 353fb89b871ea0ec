"""``rl.max_tokens_per_micro_batch`` in the RL step (CPU megatron GPT, LoGRA, a frozen reference): the reference
log-probs, the losses and reports, and the prepared update (every target's direction) equal those of fixed
micro-batches of the same rows, up to the order of float sums, while the micro-batches cover far fewer positions
(the optimizer's state advances with each ``prepare``, so the stateless parts are compared: the reduced gradient
sketch of every target and the dense gradients of the other parameters); and a whole step with a token budget
trains."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from support.run_fixtures import rl_components

    with rl_components(tmp_path_factory.mktemp("dynbatch") / "run", [
            "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=4",
            "task.num_eval=0", "rl.loss.kl_coef=0.05", "rl.loss.entropy_coef=0.01"]) as built:
        yield built


def test_a_token_budget_gives_the_fixed_micro_batches_update(built):
    from support.dynbatch import largest_sketch_difference, skewed_batch, step_parts

    comps, _ = built
    batch = skewed_batch(comps, [40, 3, 2, 5, 1, 36, 4, 3, 0, 6, 2, 4])  # two near the context length
    fixed, dyn = step_parts(comps, batch, 0), step_parts(comps, batch, 64)
    assert dyn["positions"] < fixed["positions"] / 2
    assert dyn["micro_batches"] != fixed["micro_batches"]

    mask = batch.loss_mask > 0
    torch.testing.assert_close(dyn["ref"][mask], fixed["ref"][mask], rtol=1e-5, atol=1e-5)
    assert fixed["result"].num_tokens == dyn["result"].num_tokens == int(batch.loss_mask.sum())
    reports_fixed, reports_dyn = fixed["result"].reports, dyn["result"].reports
    assert set(reports_fixed) == set(reports_dyn) == {"lm", "mismatch", "entropy", "ref_kl"}
    for name in reports_fixed:
        torch.testing.assert_close(reports_dyn[name], reports_fixed[name], rtol=1e-5, atol=1e-5)
    assert reports_fixed["ref_kl"][1] > 0  # the reference took part
    assert not fixed["update"].skipped and not dyn["update"].skipped
    assert all(s.abs().max() > 0 for s in fixed["sketches"].values())
    assert largest_sketch_difference(fixed["sketches"], dyn["sketches"]) < 1e-4
    assert dyn["update"].grad_norm == pytest.approx(fixed["update"].grad_norm, rel=1e-4)


def test_a_whole_step_with_a_token_budget_trains(built, monkeypatch):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    monkeypatch.setattr(comps.cfg.rl, "max_tokens_per_micro_batch", 48)
    returned: list[float] = []

    def score(problem, completion):
        reward = float(len(returned) % 2 == 0)
        returned.append(reward)
        return reward, reward == 1.0

    monkeypatch.setattr(comps.task, "score", score)
    from support.step_spies import record_packing

    from megatron_logra.rl.batching import plan_microbatches

    calls = record_packing(monkeypatch)
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
    record = rl_update(comps, state)
    assert not record["skipped"] and math.isfinite(record["loss"])
    # the positions the micro-batches computed and the padding among them, from the step's samples
    (call,) = calls
    batch = call["batch"]
    plan = plan_microbatches(batch, 4, 48, comps.cfg.sequence_multiple())
    assert record["train_positions"] == sum(len(p.rows) * p.length for p in plan) < batch.tokens.numel()
    filled = sum(len(p) + len(c) - 1 for p, c in zip(call["prompts"], call["completions"]))
    assert record["padding_share"] == pytest.approx(1 - filled / record["train_positions"])
    assert any(not torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())


def test_the_warm_start_with_a_token_budget_trains_the_fixed_micro_batches_weights(tmp_path):
    """The supervised warm start (5 steps of ``sft.batch_size`` demonstrations) takes the same budget: its weights
    equal those of fixed micro-batches up to the order of float sums."""
    from support.run_fixtures import rl_components

    weights = []
    for budget in (0, 40):
        with rl_components(tmp_path / f"run{budget}", ["sft.batch_size=12", "rl.micro_batch_size=4",
                                                       "task.num_eval=0", f"rl.max_tokens_per_micro_batch={budget}"]
                           ) as (comps, _):
            weights.append({n: p.detach().clone() for n, p in comps.model.named_parameters()})
    fixed, dynamic = weights
    assert fixed.keys() == dynamic.keys()
    moved = 0
    for name, w in fixed.items():
        torch.testing.assert_close(dynamic[name], w, rtol=1e-4, atol=1e-5)
        moved += not torch.equal(dynamic[name], w)
    assert moved  # the micro-batches did differ (float order), so the comparison is not of one computation
