"""Dynamic sampling (``rl.dynamic_sampling_rounds``) on the real CPU components (megatron GPT, LoGRA, embedded
engine): groups of equal rewards are replaced by the informative groups of fresh prompts, drawn from indices
past the training stream's and the same when the step is run again; the step's reward statistics cover
every rollout generated; with nothing informative to find, the rounds run out and the step is skipped as before.
The over-long penalty (``rl.overlong_buffer``) is DAPO's soft punishment, applied to the rewards of the rollouts.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

P, G = 4, 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from support.run_fixtures import rl_components

    with rl_components(tmp_path_factory.mktemp("dynsample") / "run", [
            "rl.steps=4", f"rl.prompts_per_step={P}", f"rl.group_size={G}", "rl.micro_batch_size=16",
            "task.num_eval=0", "rl.dynamic_sampling_rounds=2"]) as built:
        yield built


class Scorer:
    """Reward 0 for every sample of a prompt in ``uniform``; else 1, 0, 1, 0, ... in scoring order (mixed
    groups). Records every reward it returns, per prompt."""

    def __init__(self, uniform) -> None:
        self.uniform, self.calls, self.returned = set(uniform), 0, []

    def __call__(self, problem, completion):
        if problem.prompt in self.uniform:
            reward = 0.0
        else:
            reward, self.calls = float(self.calls % 2 == 0), self.calls + 1
        self.returned.append((problem.prompt, reward))
        return reward, reward == 1.0


@pytest.fixture
def scoring(built, monkeypatch):
    comps, _ = built

    def use(uniform) -> Scorer:
        scorer = Scorer(uniform)
        monkeypatch.setattr(comps.task, "score", scorer)
        return scorer

    return use


def _drawn(task, first: int, count: int) -> list[str]:
    return [task.train_problem(first + i).prompt for i in range(count)]


def test_uniform_groups_are_replaced_by_fresh_informative_ones_in_order(built, scoring):
    from megatron_logra.rl.rollout_stage import RESAMPLE_OFFSET, collect_groups

    comps, state = built
    step, rounds = state.step + 1, comps.cfg.rl.dynamic_sampling_rounds
    planned = _drawn(comps.task, (step - 1) * P, P)
    extra = _drawn(comps.task, RESAMPLE_OFFSET + (step - 1) * rounds * P, P)  # the step's first extra round
    assert extra != _drawn(comps.task, step * P, P)  # not the next step's prompts
    scoring({planned[0], planned[2]})
    got = collect_groups(comps, step)
    assert [p.prompt for p in got.problems] == [extra[0], planned[1], extra[1], planned[3]]
    assert (got.extra_rounds, got.replaced, got.uniform) == (1, 2, 0)
    assert len(got.rollouts) == P * G and got.rewards_N.shape == (P * G,)
    for k, problem in enumerate(got.problems):  # each group's rollouts come from its own prompt
        ids = comps.tokenizer(comps.cfg.rl.prompt_template.replace("{prompt}", problem.prompt))["input_ids"]
        assert all(r.prompt_ids[-len(ids):] == ids for r in got.rollouts[k * G:(k + 1) * G])
        assert len(set(got.rewards_N[k * G:(k + 1) * G].tolist())) == 2
    # generated: both rounds, every rollout
    assert got.generated_4[2].item() == 2 * P * G
    # the same step again (a resumed run) draws and keeps the same prompts
    assert [p.prompt for p in collect_groups(comps, step).problems] == [p.prompt for p in got.problems]


def test_the_step_record_reports_every_rollout_generated_and_the_groups(built, scoring):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    step = state.step + 1
    planned = _drawn(comps.task, (step - 1) * P, P)
    scorer = scoring({planned[1]})
    record = rl_update(comps, state)
    rewards = [r for _, r in scorer.returned]
    assert len(rewards) == 2 * P * G  # one extra round
    assert record["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert record["accuracy"] == pytest.approx(sum(r == 1.0 for r in rewards) / len(rewards))
    assert (record["resample_rounds"], record["groups_resampled"], record["groups_uniform"]) == (1, 1, 0)
    assert not record["skipped"] and record["alpha"] is not None


def test_without_informative_prompts_the_rounds_run_out_and_the_step_is_skipped(built, scoring):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}

    class Everything:
        def __contains__(self, prompt):
            return True

    scorer = scoring(())
    scorer.uniform = Everything()
    rounds = comps.cfg.rl.dynamic_sampling_rounds
    record = rl_update(comps, state)
    assert len(scorer.returned) == (1 + rounds) * P * G
    assert (record["resample_rounds"], record["groups_resampled"], record["groups_uniform"]) == (rounds, 0, P)
    assert record["skipped"] and record["skip_reason"] == "zero advantages"
    assert all(torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())


def test_off_keeps_the_planned_prompts_and_counts_uniform_groups(built, scoring, monkeypatch):
    from megatron_logra.rl.rollout_stage import collect_groups

    comps, state = built
    monkeypatch.setattr(comps.cfg.rl, "dynamic_sampling_rounds", 0)
    step = state.step + 1
    planned = _drawn(comps.task, (step - 1) * P, P)
    scorer = scoring({planned[0]})
    got = collect_groups(comps, step)
    assert [p.prompt for p in got.problems] == planned
    assert (got.extra_rounds, got.replaced, got.uniform) == (0, 0, 1) and len(scorer.returned) == P * G


def test_dynamic_sampling_needs_grpo():
    from megatron_logra.config import parse_args_to_config

    with pytest.raises(ValueError, match="rl.dynamic_sampling_rounds=2 replaces groups of zero GRPO advantage.*"
                                         "rl.advantage.estimator=grpo"):
        parse_args_to_config("tiny", ["rl.dynamic_sampling_rounds=2", "rl.advantage.estimator=reinforce"])
    with pytest.raises(ValueError, match="rl.dynamic_sampling_rounds=-1 must be >= 0"):
        parse_args_to_config("tiny", ["rl.dynamic_sampling_rounds=-1"])


def _dapo_length_reward(length: int, l_max: int, l_cache: int) -> float:
    """DAPO's R_length (its eq. 13), written out: 0, then linear down to −1 over the last ``l_cache`` tokens."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("max_new, buffer, penalty", [(10, 4, 1.0), (10, 10, 0.5), (6, 1, 2.0)])
def test_overlong_penalty_is_dapos_soft_punishment(max_new, buffer, penalty):
    from megatron_logra.rl.rollout_stage import overlong_penalty

    for length in range(max_new + 3):
        assert overlong_penalty(length, max_new, buffer, penalty) == \
            pytest.approx(-penalty * _dapo_length_reward(length, max_new, buffer))
    assert overlong_penalty(max_new + 5, max_new, 0, penalty) == 0.0


def test_the_overlong_penalty_lowers_the_rewards_of_long_completions(built, monkeypatch):
    from megatron_logra.rl.rollout_stage import collect_groups

    comps, state = built
    rl = comps.cfg.rl
    monkeypatch.setattr(rl, "overlong_buffer", rl.rollout.max_new_tokens)
    monkeypatch.setattr(rl, "overlong_penalty", 0.5)
    monkeypatch.setattr(comps.task, "score", lambda problem, completion: (1.0, True))  # all correct
    # a third of the vocabulary ends a completion: the barely trained model's completions get several lengths
    monkeypatch.setattr(comps, "stop_ids", sorted(set(comps.stop_ids) | set(range(0, len(comps.tokenizer), 3))))
    got = collect_groups(comps, state.step + 1)
    lengths = [len(r.completion_ids) for r in got.rollouts]
    assert len(set(lengths)) > 1  # the case this is about: completions of several lengths
    expected = [1.0 + 0.5 * _dapo_length_reward(n, rl.rollout.max_new_tokens, rl.overlong_buffer) for n in lengths]
    assert got.rewards_N.tolist() == pytest.approx(expected)
    assert got.correct_N.tolist() == [1.0] * len(lengths)  # accuracy is not shaped
