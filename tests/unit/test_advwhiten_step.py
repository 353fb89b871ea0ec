"""``rl.advantage.normalize=true`` in a real RL step (CPU megatron GPT, LoGRA, embedded engine): the advantages the
step trains on are the GRPO ones whitened over the batch's loss tokens (each completion's tokens), the record
carries their std before whitening, and the update is applied; a step of uniform groups only still has zero
advantages and applies nothing, with the groups counted as before."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

P, G = 4, 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from support.run_fixtures import rl_components

    with rl_components(tmp_path_factory.mktemp("advwhiten") / "run", [
            "rl.steps=4", f"rl.prompts_per_step={P}", f"rl.group_size={G}", "rl.micro_batch_size=16",
            "task.num_eval=0", "rl.advantage.normalize=true"]) as built:
        yield built


@pytest.fixture
def trained_on(built, monkeypatch):
    """Each step's (completions, advantages) as handed to ``pack_sequences``; completions of several lengths."""
    from support.step_spies import record_packing

    comps, _ = built
    calls = record_packing(monkeypatch)
    # a third of the vocabulary ends a completion: the barely trained model's completions get several lengths
    monkeypatch.setattr(comps, "stop_ids", sorted(set(comps.stop_ids) | set(range(0, len(comps.tokenizer), 3))))
    return calls


def _score(comps, monkeypatch, uniform) -> list[float]:
    """Reward 0 for every sample of a prompt in ``uniform``; else 1, 0, 1, 0, ... in scoring order."""
    returned: list[float] = []

    def score(problem, completion):
        reward = 0.0 if uniform(problem.prompt) else float(len(returned) % 2 == 0)
        returned.append(reward)
        return reward, reward == 1.0

    monkeypatch.setattr(comps.task, "score", score)
    return returned


def test_the_step_trains_on_grpo_advantages_whitened_over_the_loss_tokens(built, trained_on, monkeypatch):
    from megatron_logra.rl.advantages import grpo_advantages
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    first = comps.task.train_problem(state.step * P).prompt  # the step's first group: uniform
    rewards = _score(comps, monkeypatch, lambda prompt: prompt == first)
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
    record = rl_update(comps, state)
    (call,) = trained_on
    completions, advantages = call["completions"], call["advantages"]
    counts = [len(c) for c in completions]
    assert len(set(counts)) > 1  # token weighting differs from sequence weighting
    raw = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), G).double()
    tokens = torch.cat([raw[i].repeat(n) for i, n in enumerate(counts)])
    mean, std = tokens.mean().item(), tokens.std().item()
    want = [(a - mean) / math.sqrt(std * std + 1e-8) for a in raw.tolist()]
    assert advantages == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert advantages[0] != 0.0  # the uniform group's tokens take part and move by the mean (as slime's)
    assert record["advantage_std_raw"] == pytest.approx(std)
    assert record["groups_uniform"] == 1  # counted on the rewards, as before
    assert not record["skipped"] and record["alpha"] is not None and math.isfinite(record["loss"])
    assert any(not torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())


def test_a_step_of_uniform_groups_only_still_applies_nothing(built, trained_on, monkeypatch):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    _score(comps, monkeypatch, lambda prompt: True)
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
    record = rl_update(comps, state)
    assert record["skipped"] and record["skip_reason"] == "zero advantages"
    assert record["groups_uniform"] == P and record["advantage_std_raw"] == 0.0
    assert trained_on == []
    assert all(torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())
