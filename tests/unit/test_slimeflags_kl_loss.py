"""slime's KL-loss flags on a launch line: ``--kl-loss-coef`` sets ``rl.loss.kl_coef``; ``--use-kl-loss`` (slime's
switch for the KL loss, which is on here whenever ``rl.loss.kl_coef > 0``) is accepted with a note where the
config gives the penalty a weight and refused alone, naming ``rl.loss.kl_coef``; ``--kl-loss-type`` sets
``rl.loss.kl_estimator`` to slime's estimator of the same name (``k2``, ``k3``, ``low_var_kl``: k3 clamped, checked
against slime's formula, values and gradients) and refuses ``k1`` (refused here on purpose) naming ``k2``."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.config import parse_args_to_config
from support.cli import exit_2

KL_LOGGER = "megatron_logra.megatron_flags"


def _notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(KL_LOGGER)]


def test_kl_loss_coef_sets_the_penalty_weight_and_says_it_is_on_without_use_kl_loss(caplog):
    with caplog.at_level(logging.WARNING, logger=KL_LOGGER):
        cfg = parse_args_to_config("tiny", ["--kl-loss-coef", "0.05"])
    assert cfg.rl.loss.kl_coef == pytest.approx(0.05)
    (note,) = _notes(caplog)
    assert "rl.loss.kl_coef" in note and "--use-kl-loss" in note, note
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=KL_LOGGER):
        assert parse_args_to_config("tiny", ["--kl-loss-coef=0"]).rl.loss.kl_coef == 0  # off: nothing to say
    assert _notes(caplog) == []


@pytest.mark.parametrize("weight", [["--kl-loss-coef", "0.05"], ["rl.loss.kl_coef=0.05"]])
def test_use_kl_loss_with_a_weight_is_accepted_with_a_note(weight, caplog):
    with caplog.at_level(logging.WARNING, logger=KL_LOGGER):
        cfg = parse_args_to_config("tiny", ["--use-kl-loss", *weight])
    assert (cfg.rl.loss.kl_coef, cfg.rl.loss.kl_estimator) == (pytest.approx(0.05), "k3")
    (note,) = _notes(caplog)
    assert note.startswith("--use-kl-loss is accepted") and "rl.loss.kl_coef=0.05 > 0" in note, note
    assert "rl.loss.kl_estimator=k3" in note and "k1" in note, note  # slime's default estimator is not this one


def test_use_kl_loss_with_a_zero_weight_given_is_accepted_and_says_the_penalty_is_off(caplog):
    with caplog.at_level(logging.WARNING, logger=KL_LOGGER):
        cfg = parse_args_to_config("tiny", ["--use-kl-loss", "--kl-loss-coef", "0", "--kl-loss-type", "k2"])
    assert (cfg.rl.loss.kl_coef, cfg.rl.loss.kl_estimator) == (0.0, "k2")
    (note,) = _notes(caplog)
    assert "rl.loss.kl_coef=0" in note and "no KL penalty" in note, note


def test_use_kl_loss_alone_is_refused_naming_the_weight_field(capsys):
    with pytest.raises(ValueError) as err:
        parse_args_to_config("tiny", ["--use-kl-loss"])
    message = str(err.value)
    assert message.startswith("--use-kl-loss") and "rl.loss.kl_coef" in message and "--kl-loss-coef" in message
    line = [l for l in exit_2(["config", "tiny", "--use-kl-loss"], capsys).splitlines() if "error:" in l]
    assert len(line) == 1 and "rl.loss.kl_coef" in line[0], line


def test_use_kl_loss_with_the_lm_job_is_refused():
    with pytest.raises(ValueError, match=r"--use-kl-loss .*job=lm"):
        parse_args_to_config("lm-tiny", ["--use-kl-loss", "job=lm"])


@pytest.mark.parametrize("value", ["k2", "k3", "low_var_kl"])
def test_kl_loss_type_of_the_same_estimator_sets_it(value):
    cfg = parse_args_to_config("tiny", ["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", value])
    assert cfg.rl.loss.kl_estimator == value
    assert parse_args_to_config("tiny", [f"--kl-loss-type={value}"]).rl.loss.kl_estimator == value


@pytest.mark.parametrize("value, nearest", [("k1", "k2")])
def test_kl_loss_type_of_another_estimator_is_refused_naming_the_nearest(value, nearest):
    with pytest.raises(ValueError) as err:
        parse_args_to_config("tiny", ["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", value])
    message = str(err.value)
    assert message.startswith(f"--kl-loss-type {value}"), message
    assert f"the nearest is --kl-loss-type {nearest} (rl.loss.kl_estimator={nearest}" in message, message


def test_an_unknown_kl_loss_type_is_refused_listing_both_sides():
    with pytest.raises(ValueError, match=r"--kl-loss-type 'k4': slime's values are k1, k2, k3 and low_var_kl; "
                                         r"this trainer takes k2, k3 or low_var_kl"):
        parse_args_to_config("tiny", ["--kl-loss-type", "k4"])


def test_kl_loss_type_and_the_field_at_other_values_are_refused():
    with pytest.raises(ValueError, match=r"rl.loss.kl_estimator .*--kl-loss-type k2.*rl.loss.kl_estimator=k3"):
        parse_args_to_config("tiny", ["--kl-loss-type", "k2", "rl.loss.kl_estimator=k3"])


def _slime_kl(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """slime's per-token ``compute_approx_kl`` (slime/utils/ppo_utils.py), written out here."""
    log_ratio = logp - ref
    if kind == "k2":
        return log_ratio ** 2 / 2.0
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    return k3.clamp(-10, 10) if kind == "low_var_kl" else k3


def test_the_mapped_estimators_are_slimes_values_and_gradients():
    """k2, k3 and low_var_kl are slime's estimators of those names, values and gradients; low_var_kl differs from
    k3 where the clamp cuts it, and passes no gradient through the token it cuts."""
    from megatron_logra.rl.losses import kl_penalty

    ref = torch.tensor([[-0.3, -1.0, -1.0, -0.7]], dtype=torch.float64)  # the third token's k3 is past 10
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    for kind in ("k2", "k3", "low_var_kl"):
        mine = torch.tensor([[-0.1, -2.0, -15.0, -0.7]], dtype=torch.float64, requires_grad=True)
        theirs = mine.detach().clone().requires_grad_(True)
        value = kl_penalty(mine, ref, mask, kind)
        expected = (_slime_kl(theirs, ref, kind) * mask).sum()
        assert torch.allclose(value, expected), kind
        value.backward()
        expected.backward()
        assert torch.allclose(mine.grad, theirs.grad), kind
        if kind == "low_var_kl":
            assert mine.grad[0, 2] == 0 and mine.grad[0, 1] != 0
    logp = torch.tensor([[-0.1, -2.0, -15.0, -0.7]], dtype=torch.float64)
    assert not torch.allclose(kl_penalty(logp, ref, mask, "low_var_kl"), kl_penalty(logp, ref, mask, "k3"))
    assert torch.allclose(kl_penalty(logp[:, :2], ref[:, :2], mask[:, :2], "low_var_kl"),
                          kl_penalty(logp[:, :2], ref[:, :2], mask[:, :2], "k3"))


def test_the_help_lists_the_kl_flags():
    from megatron_logra.cli.usage import command_help
    from megatron_logra.megatron_flags import known_flags

    text = command_help("train")
    for flag in ("--kl-loss-coef", "--use-kl-loss", "--kl-loss-type"):
        assert flag in text
        assert flag[2:] in known_flags()
