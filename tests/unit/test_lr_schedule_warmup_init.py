"""``--lr-warmup-init`` is the first warmup step's lr of the lr ``--lr`` sets exactly as given, not
``peak × (init / peak)``.

With ``--lr 1e-4 --lr-warmup-init 2e-7`` the ratio round trip gives 1.9999999999999996e-07; the first step of the
warmup must take 2e-07. Every other step keeps the lr the ratio gave, bit for bit.
"""

from __future__ import annotations

import json

import pytest

from megatron_logra.cli import main, resume_differences
from megatron_logra.config import RunConfig, from_dict, apply_overrides, parse_args_to_config
from megatron_logra.optim.schedule import DECAY_STYLES, LRScheduleConfig, lr_multiplier, scheduled_lr
from support.run_fixtures import saved_with_ratios

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

PEAK, INIT, OTHER, WARMUP = 1e-4, 2e-7, 3e-3, 4
assert PEAK * (INIT / PEAK) != INIT  # the pair this file is about: the ratio round trip misses the initial lr

SMALL = ["train.progress=false", "train.eval_sequences=8", "train.eval_interval=0", "--num-layers", "1",
         "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]
FLAGS = ["--lr", str(PEAK), "--lr-warmup-init", str(INIT), "--lr-warmup-iters", str(WARMUP),
         "--lr-decay-style", "cosine", "train.steps=10"]


def test_lr_warmup_init_flag_is_stored_as_given():
    cfg = parse_args_to_config("lm-tiny", FLAGS)
    schedule = cfg.optimizer.schedule
    assert (schedule.warmup_init_lr, schedule.warmup_init_ratio) == (INIT, 0.0)
    peak_field, peak = next(iter(cfg.optimizer.scheduled_lrs().items()))
    assert (peak_field, peak) == ("optimizer.logra.lr", PEAK)
    assert scheduled_lr(peak, 1, schedule, 10, peak) == INIT  # the first warmup step (n = 0), exactly
    assert lr_multiplier(1, schedule, 10, peak) == INIT / PEAK
    dense = parse_args_to_config("lm-tiny-adam", FLAGS).optimizer  # dense AdamW: of native.lr
    assert (dense.native.lr, dense.schedule.warmup_init_lr) == (PEAK, INIT)


def test_warmup_interpolates_megatrons_way():
    """``init + (peak − init)·n/W`` for the reference lr; the same fraction of its own peak for another lr."""
    schedule = LRScheduleConfig(warmup_steps=WARMUP, warmup_init_lr=INIT, decay_style="linear", decay_steps=10)
    for n in range(WARMUP + 1):
        fraction = n / WARMUP
        assert scheduled_lr(PEAK, n + 1, schedule, None, PEAK) == pytest.approx(INIT + (PEAK - INIT) * fraction,
                                                                                rel=1e-15)
        start = OTHER * INIT / PEAK
        assert scheduled_lr(OTHER, n + 1, schedule, None, PEAK) == pytest.approx(start + (OTHER - start) * fraction,
                                                                                 rel=1e-15)
    assert scheduled_lr(PEAK, WARMUP + 1, schedule, None, PEAK) == PEAK


@pytest.mark.parametrize("style", DECAY_STYLES)
@pytest.mark.parametrize("floor", [{"min_lr_ratio": 0.1}, {"min_lr": 3e-6}], ids=["min_lr_ratio", "min_lr"])
def test_only_the_first_warmup_step_changes_and_only_with_warmup_init_lr(style, floor):
    """Against the ratio ``--lr-warmup-init`` was stored as before: every lr of every step but the first is bitwise
    the same; the first is ``warmup_init_lr`` itself for the reference lr. Without the field nothing changes."""
    decay_steps = 12
    as_ratio = LRScheduleConfig(warmup_steps=WARMUP, warmup_init_ratio=INIT / PEAK, decay_style=style,
                                decay_steps=decay_steps, **floor)
    absolute = LRScheduleConfig(warmup_steps=WARMUP, warmup_init_lr=INIT, decay_style=style,
                                decay_steps=decay_steps, **floor)
    steps = range(1, decay_steps + 8)  # the warmup, the decay, its last step and the floor after it
    for peak in (PEAK, OTHER):
        before = [scheduled_lr(peak, t, as_ratio, None, PEAK) for t in steps]
        after = [scheduled_lr(peak, t, absolute, None, PEAK) for t in steps]
        assert after[1:] == before[1:]
        assert before[0] == peak * (INIT / PEAK)  # without the field: the ratio times the peak, as before
        assert after[0] == pytest.approx(peak * INIT / PEAK, rel=1e-15)
    assert scheduled_lr(PEAK, 1, absolute, None, PEAK) == INIT != scheduled_lr(PEAK, 1, as_ratio, None, PEAK)


@pytest.mark.parametrize("args, named", [
    (["optimizer.schedule.warmup_init_lr=1e-7", "optimizer.schedule.warmup_init_ratio=0.1"],
     r"optimizer\.schedule\.warmup_init_lr=1e-07 and optimizer\.schedule\.warmup_init_ratio=0\.1 both set the start "
     r"of the warmup; give one of them"),
    (["--lr", "1e-4", "optimizer.schedule.warmup_init_lr=2e-4"],
     r"optimizer\.schedule\.warmup_init_lr=0\.0002 exceeds the peak lr optimizer\.logra\.lr=0\.0001"),
    (["optimizer.schedule.warmup_init_lr=-1"], r"optimizer\.schedule\.warmup_init_lr=-1\.0 must be a finite lr >= 0"),
])
def test_bad_warmup_init_lr_is_refused_naming_the_field(args, named):
    with pytest.raises(ValueError, match=named):
        parse_args_to_config("lm-tiny", ["--lr-warmup-iters", "3", *args])


def test_warmup_init_lr_needs_the_reference_lr():
    schedule = LRScheduleConfig(warmup_steps=2, warmup_init_lr=INIT)
    with pytest.raises(ValueError, match=r"optimizer\.schedule\.warmup_init_lr is an absolute lr"):
        lr_multiplier(1, schedule)


# --------------------------------------------------------------------------- runs saved with the ratio


def _saved_before_warmup_init_lr(ratio: float = INIT / PEAK) -> dict:
    """The config a run of :data:`FLAGS` saved while ``--lr-warmup-init`` was kept as ``warmup_init_ratio``."""
    return saved_with_ratios("lm-tiny", FLAGS, {"warmup_init_lr": ratio})


def test_lr_warmup_init_flag_overrides_a_saved_warmup_init_ratio():
    """``--resume RUN_DIR --lr-warmup-init X``: the saved ratio gives way to the flag, instead of 'both set'."""
    cfg = from_dict(RunConfig, _saved_before_warmup_init_lr(), validate=False)
    schedule = apply_overrides(cfg, ["--lr-warmup-init", str(INIT)]).optimizer.schedule
    assert (schedule.warmup_init_lr, schedule.warmup_init_ratio) == (INIT, 0.0)
    cfg = from_dict(RunConfig, _saved_before_warmup_init_lr(), validate=False)
    with pytest.raises(ValueError, match="both set the start of the warmup"):  # given together: still refused
        apply_overrides(cfg, ["--lr-warmup-init", str(INIT), "optimizer.schedule.warmup_init_ratio=0.5"])


def test_recipe_resume_accepts_the_same_lr_warmup_init_flag_as_the_saved_ratio():
    """``train.resume=true`` with the command line the run was started with: its saved ratio is that lr."""
    cfg = parse_args_to_config("lm-tiny", FLAGS)
    assert resume_differences(_saved_before_warmup_init_lr(), cfg) == []
    differ = resume_differences(_saved_before_warmup_init_lr(ratio=0.5), cfg)  # another initial lr still differs
    assert [name for name, _, _ in differ] == ["optimizer.schedule.warmup_init_ratio"]
    both = saved_with_ratios("lm-tiny", [*FLAGS, "--min-lr", "1e-7"],  # both absolute lrs as ratios
                             {"warmup_init_lr": INIT / PEAK, "min_lr": 1e-7 / PEAK})
    assert resume_differences(both, parse_args_to_config("lm-tiny", [*FLAGS, "--min-lr", "1e-7"])) == []


@pytest.mark.parametrize("recipe, key", [("lm-tiny", "logra_lr"), ("lm-tiny-adam", "lr")])
def test_first_warmup_lr_of_a_run_is_exactly_lr_warmup_init(tmp_path, one_thread, recipe, key):
    """The lr the first step's metrics record reports (the one applied) is exactly ``--lr-warmup-init``."""
    run = tmp_path / "run"
    assert main(["train", recipe, f"train.run_dir={run}", "train.steps=5", "--lr", str(PEAK), "--lr-warmup-init",
                 str(INIT), "--lr-warmup-iters", "2", *SMALL]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = [r[key] for r in records]
    assert lrs[0] == INIT and lrs[2:] == [PEAK] * 3
    assert lrs[1] == PEAK * (INIT / PEAK + (1 - INIT / PEAK) * 0.5)
