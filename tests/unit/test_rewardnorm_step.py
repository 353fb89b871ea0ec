"""slime's ``--disable-rewards-normalization`` (``rl.advantage.baseline=none``) in real RL steps (CPU megatron GPT,
LoGRA, embedded engine, a slime reward function written into ``tmp_path`` whose reward depends on the problem
only): the step trains on the raw rewards,
so a batch whose every group has equal rewards is trained on, not skipped (its groups still counted uniform);
whitened (``--normalize-advantages``) such a batch is centred over the loss tokens; a batch of zero rewards
only is a step of zero advantages and applies nothing."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from support.jsonl_rows import plugin_and_file

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

P, G = 4, 2

SLIME_RM = '''
SCALE = [1.0]


async def by_answer(args, sample):
    """SCALE × the answer / 10 (answers are 1 .. 40): every group's rewards are equal, the groups' differ."""
    return SCALE[0] * int(sample.label) / 10
'''


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from _pytest.monkeypatch import MonkeyPatch
    from support.run_fixtures import rl_components

    tmp = tmp_path_factory.mktemp("rewardnorm")
    patch = MonkeyPatch()
    try:
        name, data = plugin_and_file(tmp, patch, SLIME_RM, "mlogra_rewardnorm")
        with rl_components(tmp / "run", [
                "rl.steps=4", f"rl.prompts_per_step={P}", f"rl.group_size={G}", "rl.micro_batch_size=8",
                "task.num_eval=0", f"task.datasets=jsonl:{data}", f"task.reward=slime:{name}.by_answer",
                "--disable-rewards-normalization"]) as (comps, state):
            yield comps, state, importlib.import_module(name)
    finally:
        patch.undo()


@pytest.fixture
def trained_on(built, monkeypatch):
    """Each step's (completions, advantages) as the real step hands them to ``pack_sequences``."""
    from support.step_spies import record_packing

    calls = record_packing(monkeypatch)
    return calls


def _expected(comps, state, scale: float) -> list[float]:
    """By hand: the step's problems (train indices step*P .. step*P+P-1), G rollouts each, reward scale × answer
    / 10, as the float32 the advantages are computed in."""
    labels = [int(comps.task.train_problem(state.step * P + i).answer) for i in range(P)]
    return torch.tensor([scale * label / 10 for label in labels for _ in range(G)], dtype=torch.float32).tolist()


def _params(comps) -> dict:
    return {n: p.detach().clone() for n, p in comps.model.named_parameters()}


def test_uniform_groups_train_on_their_raw_rewards(built, trained_on):
    from megatron_logra.rl.loop import rl_update

    comps, state, module = built
    module.SCALE[0] = 1.5
    want = _expected(comps, state, 1.5)
    assert all(w > 0 for w in want)
    before = _params(comps)
    record = rl_update(comps, state)
    (call,) = trained_on
    advantages = call["advantages"]
    assert advantages == want  # exact: the float32 rewards themselves
    assert record["groups_uniform"] == P and not record["skipped"] and math.isfinite(record["loss"])
    assert any(not torch.equal(p.detach(), before[n]) for n, p in comps.model.named_parameters())


def test_whitened_raw_rewards_are_centred_over_the_loss_tokens(built, trained_on, monkeypatch):
    from megatron_logra.rl.loop import rl_update

    comps, state, module = built
    module.SCALE[0] = 1.0
    monkeypatch.setattr(comps.cfg.rl.advantage, "normalize", True)
    want = _expected(comps, state, 1.0)
    record = rl_update(comps, state)
    (call,) = trained_on
    completions, advantages = call["completions"], call["advantages"]
    tokens = torch.cat([torch.tensor(w, dtype=torch.float64).repeat(len(c)) for w, c in zip(want, completions)])
    assert len(set(want)) > 1  # the step's problems differ (rewards all equal would whiten to 0)
    mean, std = tokens.mean().item(), tokens.std().item()
    assert advantages == pytest.approx([(w - mean) / math.sqrt(std * std + 1e-8) for w in want], rel=1e-5, abs=1e-6)
    assert record["advantage_std_raw"] == pytest.approx(std) and not record["skipped"]


def test_a_batch_of_zero_rewards_is_a_step_of_zero_advantages(built, trained_on):
    from megatron_logra.rl.loop import rl_update

    comps, state, module = built
    module.SCALE[0] = 0.0
    before = _params(comps)
    record = rl_update(comps, state)
    assert record["skipped"] and record["skip_reason"] == "zero advantages" and trained_on == []
    assert all(torch.equal(p.detach(), before[n]) for n, p in comps.model.named_parameters())
