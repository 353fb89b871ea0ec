"""slime samples held-out answers at the rollout's temperature and top-p where its line gives no ``--eval-temperature``
/ ``--eval-top-p``; held-out evaluation here is greedy by default. A line with ``--n-samples-per-eval-prompt k > 1``
and no held-out temperature takes the rollout's, as slime does, instead of being refused; whatever the line gives
itself is kept, and a greedy temperature given outright is still refused for k > 1."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config


def _eval(cfg):
    ro = cfg.rl.rollout
    return ro.eval_samples, ro.eval_temperature, ro.eval_top_p


def test_k_samples_without_a_held_out_temperature_take_the_rollouts(caplog):
    with caplog.at_level(logging.INFO):
        cfg = parse_args_to_config("tiny", ["--n-samples-per-eval-prompt", "4", "--rollout-temperature", "0.9",
                                            "--rollout-top-p", "0.7"])
    assert _eval(cfg) == (4, 0.9, 0.7)
    assert any("as slime samples them" in r.getMessage() for r in caplog.records)
    # the order of the flags does not matter
    cfg = parse_args_to_config("tiny", ["--rollout-top-p", "0.7", "--rollout-temperature", "0.9",
                                        "--n-samples-per-eval-prompt", "4"])
    assert _eval(cfg) == (4, 0.9, 0.7)


def test_what_the_line_gives_is_kept():
    assert _eval(parse_args_to_config("tiny", ["--n-samples-per-eval-prompt", "4", "--eval-temperature", "0.6"])) \
        == (4, 0.6, 1.0)
    assert _eval(parse_args_to_config("tiny", ["--rollout-temperature", "0.9", "--n-samples-per-eval-prompt", "4",
                                               "--eval-top-p", "0.5"])) == (4, 0.9, 0.5)
    assert _eval(parse_args_to_config("tiny", ["--n-samples-per-eval-prompt", "1"])) == (1, 0.0, 1.0)  # greedy


@pytest.mark.parametrize("args", [["rl.rollout.eval_samples=4"],
                                  ["--n-samples-per-eval-prompt", "4", "rl.rollout.eval_temperature=0"]])
def test_greedy_k_samples_given_outright_are_still_refused(args):
    with pytest.raises(ValueError, match="eval_samples > 1 needs rl.rollout.eval_temperature > 0"):
        parse_args_to_config("tiny", args)
