"""A slime reward function's ``args`` at a held-out evaluation, as slime's: ``rollout_max_response_len`` is the
training cap (``rl.rollout.max_new_tokens``), ``eval_max_response_len`` the evaluation's
(``rl.rollout.eval_max_new_tokens``, slime's ``--eval-max-response-len``; None where it is 0, as slime's unset flag)
and ``n_samples_per_eval_prompt`` the evaluation's samples per problem; the same in reward worker processes.

A real slime-style reward module written into ``tmp_path``, real tasks built as the RL job builds them."""

from __future__ import annotations

import json

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rewards import build_task
from megatron_logra.rewards.slime_rm import run_args, with_run_args
from megatron_logra.rl.step_guard import score_rollouts
from support.jsonl_rows import plugin_and_file

SLIME_RM = '''
def caps(args, sample):
    """The caps and eval samples it sees, spelt into a reward: train cap x 10000 + (eval cap or 0) x 10 + k."""
    return args.rollout_max_response_len * 10000 + (args.eval_max_response_len or 0) * 10 + \\
        args.n_samples_per_eval_prompt
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    return plugin_and_file(tmp_path, monkeypatch, SLIME_RM, "mlogra_slimeevalcap")


def _config(plugin, *line):
    name, data = plugin
    return parse_args_to_config("tiny", [f"task.datasets=jsonl:{data}", f"task.reward=slime:{name}.caps",
                                         "--rollout-max-response-len", "24", *line])


def test_the_eval_cap_is_its_own_field_of_args(plugin):
    cfg = _config(plugin, "--eval-max-response-len", "40", "--n-samples-per-eval-prompt", "3",
                  "rl.rollout.eval_temperature=1")
    args = run_args(cfg.rl)
    assert (args["rollout_max_response_len"], args["eval_max_response_len"], args["n_samples_per_eval_prompt"]) == \
        (24, 40, 3)
    unset = run_args(_config(plugin).rl)  # slime's unset --eval-max-response-len: the evaluation's cap is training's
    assert unset["rollout_max_response_len"] == 24 and unset["eval_max_response_len"] is None
    assert unset["n_samples_per_eval_prompt"] == 1


@pytest.mark.parametrize("workers", [0, 1])
def test_the_function_sees_both_caps(plugin, workers):
    cfg = _config(plugin, "--eval-max-response-len", "40", f"task.reward_workers={workers}")
    task = build_task(with_run_args(cfg.task, cfg.rl))
    try:
        (source,) = task.sources
        problem = source.problems[0]
        assert score_rollouts(task, [problem], ["x"], "the held-out evaluation") == [(24 * 10000 + 400 + 1, True)]
        unset = _config(plugin, f"task.reward_workers={workers}")
        other = build_task(with_run_args(unset.task, unset.rl))
        try:
            assert score_rollouts(other, [problem], ["x"], "the held-out evaluation") == [(24 * 10000 + 1, True)]
        finally:
            other.close()
    finally:
        task.close()
    assert json.dumps(cfg.task.__dict__.get("slime_run_args")) == "null"  # the user's config is left as it was
