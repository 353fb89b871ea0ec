"""``--min-lr`` is the floor of the lr ``--lr`` sets exactly as given, not ``peak × (min_lr / peak)``.

With ``--lr 1e-4 --min-lr 1e-7`` the ratio round trip gives 9.999999999999998e-08; the floor must be 1e-07.
"""

from __future__ import annotations

import json

import pytest

from megatron_logra.cli import main
from megatron_logra.optim.schedule import LRScheduleConfig, lr_multiplier, scheduled_lr
from megatron_logra.config import parse_args_to_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

PEAK, FLOOR = 1e-4, 1e-7
assert PEAK * (FLOOR / PEAK) != FLOOR  # the pair this file is about: the ratio round trip misses the floor

SMALL = ["train.progress=false", "train.eval_sequences=8", "train.eval_interval=0", "--num-layers", "1",
         "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]
SCHEDULE = ["--lr", str(PEAK), "--min-lr", str(FLOOR), "--lr-decay-style", "linear", "--lr-decay-iters", "3"]


def test_min_lr_flag_is_stored_as_given():
    cfg = parse_args_to_config("lm-tiny", SCHEDULE)
    schedule = cfg.optimizer.schedule
    assert schedule.min_lr == FLOOR and schedule.min_lr_ratio == 0.0
    peak_field, peak = next(iter(cfg.optimizer.scheduled_lrs().items()))
    assert peak == PEAK
    for step in (4, 5, 100):  # after the decay (n > decay_steps) and at its last step (n == decay_steps)
        assert scheduled_lr(peak, step, schedule, 10, peak) == FLOOR
    # another scheduled lr decays to the same fraction of its own peak
    assert scheduled_lr(0.5, 5, schedule, 10, peak) == pytest.approx(0.5 * FLOOR / PEAK, rel=1e-15)
    # before the floor: the multiplier as before
    assert scheduled_lr(peak, 2, schedule, 10, peak) == peak * lr_multiplier(2, schedule, 10, peak)


def test_inverse_square_root_floor_is_exact():
    schedule = LRScheduleConfig(decay_style="inverse-square-root", decay_steps=4 * 10 ** 6, min_lr=FLOOR)
    assert scheduled_lr(PEAK, 2 * 10 ** 6 + 1, schedule, None, PEAK) == FLOOR  # sqrt(1/n) < FLOOR / PEAK there
    assert scheduled_lr(PEAK, 101, schedule, None, PEAK) == PEAK / 10  # above the floor: peak / sqrt(n)


@pytest.mark.parametrize("args, named", [
    (["optimizer.schedule.min_lr=1e-7", "optimizer.schedule.min_lr_ratio=0.1"], "give one of them"),
    (["--lr", "1e-4", "--min-lr", "2e-4"], "exceeds the peak lr"),
    (["optimizer.schedule.min_lr=-1"], "must be a finite lr >= 0"),
])
def test_bad_min_lr_is_refused_naming_the_field(args, named):
    with pytest.raises(ValueError, match=named):
        parse_args_to_config("lm-tiny", ["--lr-decay-style", "linear", "--lr-decay-iters", "3", *args])


@pytest.mark.parametrize("recipe, key", [("lm-tiny", "logra_lr"), ("lm-tiny-adam", "lr")])
def test_floor_lr_of_a_run_is_exactly_min_lr(tmp_path, one_thread, recipe, key):
    """The lr each step's metrics record reports (the one applied) reaches exactly ``--min-lr``."""
    run = tmp_path / "run"
    assert main(["train", recipe, f"train.run_dir={run}", "train.steps=5", *SCHEDULE, *SMALL]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = [r[key] for r in records]
    assert lrs[0] == PEAK and lrs[3:] == [FLOOR, FLOOR]
