"""``optimizer.schedule.min_lr`` (``--min-lr``) with runs saved before it existed, and a reference lr of 0.

A run started with ``--min-lr X --lr P`` before the field existed saved ``min_lr_ratio = X / P`` and no
``min_lr``: continuing it with ``--resume RUN_DIR --min-lr X``, or with the same command line and
``train.resume=true``, must not be refused. A schedule whose reference lr is 0 ends every lr at 0.
"""

from __future__ import annotations

import pytest

from megatron_logra.cli import resume_differences
from megatron_logra.config import RunConfig, from_dict, apply_overrides, parse_args_to_config
from megatron_logra.optim.schedule import LRScheduleConfig, scheduled_lr
from support.run_fixtures import saved_with_ratios

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

PEAK, FLOOR = 3e-4, 1e-5
FLAGS = ["--lr", str(PEAK), "--min-lr", str(FLOOR), "--lr-decay-style", "cosine", "train.steps=10"]


def _saved_before_min_lr(ratio: float = FLOOR / PEAK) -> dict:
    """The config a run of :data:`FLAGS` saved before ``optimizer.schedule.min_lr`` existed."""
    return saved_with_ratios("lm-tiny", FLAGS, {"min_lr": ratio})


def test_min_lr_flag_overrides_a_saved_min_lr_ratio():
    """``--resume RUN_DIR --min-lr X``: the saved config's ratio gives way to the flag (it did when the flag
    set the ratio itself), instead of 'both set the floor of the decay'."""
    cfg = from_dict(RunConfig, _saved_before_min_lr(), validate=False)
    schedule = apply_overrides(cfg, ["--min-lr", str(FLOOR)]).optimizer.schedule
    assert (schedule.min_lr, schedule.min_lr_ratio) == (FLOOR, 0.0)


def test_min_lr_flag_and_ratio_given_together_are_still_refused():
    cfg = from_dict(RunConfig, _saved_before_min_lr(), validate=False)
    with pytest.raises(ValueError, match="both set the floor"):
        apply_overrides(cfg, ["--min-lr", str(FLOOR), "optimizer.schedule.min_lr_ratio=0.5"])


def test_recipe_resume_accepts_the_same_min_lr_flag_as_the_saved_ratio():
    """``train.resume=true`` with the command line the run was started with: its saved ratio is that floor."""
    cfg = parse_args_to_config("lm-tiny", FLAGS)
    assert resume_differences(_saved_before_min_lr(), cfg) == []
    # another floor is still a difference
    differ = resume_differences(_saved_before_min_lr(ratio=0.5), cfg)
    assert [name for name, _, _ in differ] == ["optimizer.schedule.min_lr_ratio"]


def test_floor_with_a_reference_lr_of_zero_is_zero():
    """``optimizer.logra.lr=0`` (the reference) with a trained non-target AdamW and ``min_lr=0``: accepted by
    the config, so the schedule must reach its floor without dividing by the reference lr."""
    cfg = parse_args_to_config("lm-tiny", ["logra.lr=0", "native.lr=1e-3", "--lr-decay-style", "linear",
                                           "optimizer.schedule.min_lr=0", "--lr-decay-iters", "2", "train.steps=4"])
    schedule = cfg.optimizer.schedule
    assert schedule.min_lr == 0.0 and cfg.optimizer.native.lr == 1e-3
    for step in (3, 4):  # at and after the end of the decay
        assert scheduled_lr(1e-3, step, schedule, 4, 0.0) == 0.0
        assert scheduled_lr(0.0, step, schedule, 4, 0.0) == 0.0
    assert scheduled_lr(1e-3, 2, LRScheduleConfig(decay_style="linear", decay_steps=2, min_lr=0.0), 4, 0.0) == 5e-4
