"""Degenerate RL steps that long runs hit, on the real CPU components (megatron GPT, LoGRA, KL control, embedded
engine): consecutive refused updates stop the run, a failing reward function names the step and sample, a step
without completion tokens (or with empty ones in the probe's rows) is handled, a non-finite KL prediction names
the step and applies nothing."""

from __future__ import annotations

import itertools
import logging
import math
import warnings
import zlib

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = parse_args_to_config("tiny", [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "sft.steps=5", "sft.init_path=",
        "tokenizer.path=", "sft.cache=false", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4",
        "rl.micro_batch_size=8", "task.num_eval=2", "rl.eval_interval=0", "rl.max_bad_steps=2",
        f"train.run_dir={tmp_path_factory.mktemp('rlaudit') / 'run'}", "train.progress=false",
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    try:
        yield comps, state
    finally:
        destroy_parallel()
        torch.set_num_threads(before)


@pytest.fixture
def alternating(built):
    """Rewards 1, 0, 1, 0, ... whatever the text: every group has nonzero advantages."""
    comps, _ = built
    counter, real = itertools.count(), comps.task.score
    comps.task.score = lambda problem, completion: (float(next(counter) % 2), False)
    yield
    comps.task.score = real


def _snapshot(comps):
    return {n: p.detach().clone() for n, p in comps.model.named_parameters()}


def _unchanged(comps, params):
    return all(torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())


def test_consecutive_non_finite_updates_stop_the_run_naming_the_step(built, alternating, caplog):
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.rl.step_guard import BadStepsError

    comps, state = built

    def overflow(module, args, out):
        if module.training:
            out = out.clone()
            out.view(-1, out.shape[-1])[0, 0] = float("inf")
        return out

    params, version = _snapshot(comps), state.weight_version
    hook = comps.model.register_forward_hook(overflow)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_logra.rl.step_guard"):
            rec = rl_update(comps, state)
        assert rec["skipped"] is True and rec["skip_reason"] == "non-finite sketch or gradient"
        assert rec["entropy"] is None and rec["loss"] is None  # no NaN in the record
        assert f"RL step {rec['step']}: update not applied" in caplog.text
        with pytest.raises(BadStepsError, match=rf"RL step {rec['step'] + 1}: 2 RL steps in a row .*max_bad_steps=2"):
            rl_update(comps, state)
    finally:
        hook.remove()
    assert _unchanged(comps, params) and state.weight_version == version == comps.engine.weight_version
    rec = rl_update(comps, state)  # a healthy step applies and ends the streak
    assert rec["skipped"] is False and rec["skip_reason"] is None and state.bad_streak == 0


@pytest.mark.parametrize("body, cause", [
    ("return float('nan')", "returned nan"),
    ("return None", "returned None"),
    ("raise KeyError('no such field')", "KeyError: 'no such field'"),
])
def test_a_failing_reward_function_names_the_step_and_the_sample(built, tmp_path, monkeypatch, body, cause):
    from megatron_logra.rewards.plugins import PluginScorer
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.rl.step_guard import RewardError

    comps, state = built
    module = f"rlaudit_reward_{abs(hash(body))}"
    (tmp_path / f"{module}.py").write_text(f"def reward(problem, completion):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = comps.task.names[0]
    monkeypatch.setitem(comps.task.scorers, source, PluginScorer(f"{module}:reward"))
    step, params = state.step, _snapshot(comps)
    with pytest.raises(RewardError, match=rf"RL step {step + 1}: the reward of sample 0 \(source '{source}'.*{cause}"):
        rl_update(comps, state)
    assert state.step == step and _unchanged(comps, params)


def test_the_step_record_counts_the_prompts_its_draws_skipped(built, alternating):
    """``prompts_skipped``: the training prompts the prompt filter (over-long ones) refused while this step drew
    its problems, summed over DP ranks; the same count as drawing those indices again on a fresh task."""
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    first, num = state.step * comps.cfg.rl.prompts_per_step, comps.cfg.rl.prompts_per_step
    for salt in range(50):  # a filter (a pure function of the text, as the real one) that skips some here
        fits = lambda prompt, k=salt: zlib.crc32(f"{k}:{prompt}".encode()) % 2 == 0  # noqa: E731
        fresh = build_task(comps.cfg.task)
        fresh.set_prompt_filter(fits)
        drawn = [fresh.train_problem(first + i) for i in range(num)]
        if sum(fresh.overlong_skips.values()):
            break
    assert all(fits(p.prompt) for p in drawn) and sum(fresh.overlong_skips.values()) > 0
    comps.task.set_prompt_filter(fits)
    try:
        record = rl_update(comps, state)
    finally:
        comps.task.set_prompt_filter(None)
    assert record["prompts_skipped"] == sum(fresh.overlong_skips.values())


def test_a_reward_failing_in_the_held_out_evaluation_names_it(built, tmp_path, monkeypatch):
    from megatron_logra.rewards.plugins import PluginScorer
    from megatron_logra.rl.loop import evaluate_accuracy
    from megatron_logra.rl.step_guard import RewardError

    comps, _ = built
    (tmp_path / "rlaudit_eval_reward.py").write_text("def reward(problem, completion):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = comps.task.names[0]
    monkeypatch.setitem(comps.task.scorers, source, PluginScorer("rlaudit_eval_reward:reward", timeout_s=5.0))
    with pytest.raises(RewardError, match=rf"^the held-out evaluation: the reward of sample 0 \(source '{source}'"):
        evaluate_accuracy(comps)


class _EmptyFirst:
    """An engine that returns empty completions for the first ``n`` prompts (as a server may: SGLang does not
    run here), the embedded engine's rollouts for the rest."""

    def __init__(self, engine, n):
        self.engine, self.n = engine, n

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        from megatron_logra.rollout.engine import Rollout

        out = self.engine.generate(prompts, params)
        return [Rollout(r.prompt_ids, [], [], False, r.weight_version) if i < self.n else r for i, r in enumerate(out)]


def test_a_step_without_completion_tokens_is_refused_not_a_crash(built, alternating, monkeypatch):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    monkeypatch.setattr(comps, "engine", _EmptyFirst(comps.engine, 10**9))
    params = _snapshot(comps)
    rec = rl_update(comps, state)
    assert rec["skipped"] is True and rec["skip_reason"] == "no completion tokens" and state.bad_streak == 1
    assert _unchanged(comps, params)
    state.bad_streak = 0


def test_empty_completions_in_the_probe_rows_do_not_stop_the_kl_control(built, alternating, monkeypatch):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    monkeypatch.setattr(comps, "engine", _EmptyFirst(comps.engine, comps.cfg.kl.probe_sequences))
    rec = rl_update(comps, state)
    assert rec["skipped"] is False and math.isfinite(rec["kl_predicted"]) and rec["kl_predicted"] > 0


def test_a_non_finite_kl_prediction_names_the_step_and_applies_nothing(built, alternating):
    from torch.autograd import forward_ad as fwAD

    from megatron_logra.kl.controller import KLControlError
    from megatron_logra.rl.loop import rl_update

    comps, state = built

    def nan_tangent(module, args, out):
        primal, tangent = fwAD.unpack_dual(out)
        if tangent is None:
            return out
        return fwAD.make_dual(primal, torch.full_like(tangent, float("nan")))

    params, applied = _snapshot(comps), comps.controller.num_updates
    hook = comps.model.register_forward_hook(nan_tangent)
    try:
        with pytest.raises(KLControlError, match=rf"RL step {state.step + 1}: predicted KL .*not finite"):
            rl_update(comps, state)
    finally:
        hook.remove()
    assert _unchanged(comps, params) and comps.controller.num_updates == applied


def test_a_non_finite_measured_kl_is_a_warning_naming_the_step(caplog):
    from megatron_logra.rl.step_guard import check_measured_kl

    with caplog.at_level(logging.WARNING, logger="megatron_logra.rl.step_guard"):
        check_measured_kl(0.01, 6)
        assert not caplog.text
        check_measured_kl(float("nan"), 7)
    assert "RL step 7: the KL measured after the update is not finite" in caplog.text


def test_max_bad_steps_must_not_be_negative():
    from megatron_logra.rl.config import RLConfig

    with pytest.raises(ValueError, match="rl.max_bad_steps=-1"):
        RLConfig(max_bad_steps=-1)


def test_a_training_prompt_too_long_mid_run_names_the_step():
    """A generated task draws its training prompts step by step; one that cannot fit says at which RL step."""
    from types import SimpleNamespace

    from megatron_logra.config import parse_args_to_config
    from megatron_logra.data.tokenizer import build_tokenizer
    from megatron_logra.rl import prompts

    cfg = parse_args_to_config("tiny", [])
    short, long = "1+2", "1+2" * cfg.model.seq_length
    c = SimpleNamespace(cfg=cfg, tokenizer=build_tokenizer(cfg.tokenizer, [cfg.rl.prompt_template, short]),
                        groups=SimpleNamespace(dp=None))
    assert len(prompts._prompt_batch(c, [SimpleNamespace(prompt=short)], 2, step=7)) == 2
    with pytest.raises(ValueError) as exc:
        prompts._prompt_batch(c, [SimpleNamespace(prompt=long)], 2, step=7)
    assert str(exc.value).startswith("RL step 7: a prompt of ") and "does not fit" in str(exc.value)
