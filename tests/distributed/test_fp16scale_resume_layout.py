"""A float16 run saved under one parallel layout and resumed under another continues at the saved loss scale.

The scaler's state (scale, growth and hysteresis trackers) is part of the optimizer's checkpoint scalars, which
do not depend on the layout. Two runs on 2 gloo ranks, each started at scale 2**15 with ``window=2`` and
``hysteresis=1`` (lm-tiny ``--fp16``, 8 sequences a step, no dropout):

* LoGRA at TP 2 and dense AdamW (lm-tiny-adam) at PP 2, 8 steps uninterrupted; the same runs stopped after step 6
  (saved there: the scale has come down from 2**15 to 4096 and gone back up to 8192, one step into its window);
* each stopped run resumed in one process (TP 1, PP 1) to step 8.

Steps 7 and 8 of the resumed runs must run at the uninterrupted runs' scales, skipping the same steps: step 7 at
8192 doubles the scale only because the checkpoint brought back one step of the window, and 16384 then overflows
at step 8. A scaler starting afresh would run step 7 at 2**15 and skip it; one that lost its growth tracker
would run step 8 at 8192. The losses agree as TP 2 and PP 2 agree with one process
(``test_fp16scale_layouts.py``).
"""

from __future__ import annotations

import json
import math

import pytest

from fp16scale_jobs_worker import COMMON_LM, run_jobs

pytestmark = pytest.mark.distributed

SCALE = [f"optimizer.loss_scale.initial={2.0**15}", "optimizer.loss_scale.window=2", "optimizer.loss_scale.hysteresis=1"]
RUNS = {"logra_tp2": ["lm-tiny", "--fp16", *COMMON_LM, *SCALE, "parallel.tp=2"],
        "adam_pp2": ["lm-tiny-adam", "--fp16", *COMMON_LM, *SCALE, "parallel.pp=2"]}
SAVED, LAST = 6, 8


@pytest.fixture(scope="module")
def runs(launcher, tmp_path_factory):
    base = tmp_path_factory.mktemp("fp16resume")
    jobs = {}
    for name, argv in RUNS.items():
        jobs[f"{name}_full"] = [*argv, f"train.steps={LAST}"]
        jobs[f"{name}_stop"] = [*argv, f"train.steps={SAVED}", f"train.save_interval={SAVED}"]
    two = run_jobs(launcher, 2, base / "two", jobs, timeout=300)
    resumed = {f"{name}_resumed": [*argv, f"train.run_dir={two.run_dir(f'{name}_stop')}", "train.resume=true",
                                   f"train.steps={LAST}", "parallel.tp=1", "parallel.pp=1"]
               for name, argv in RUNS.items()}
    one = run_jobs(launcher, 1, base / "one", resumed, timeout=300)
    return two, one


@pytest.mark.parametrize("name", list(RUNS))
def test_the_resumed_run_continues_at_the_saved_scale(runs, name):
    two, one = runs
    full = two.agreed(f"{name}_full")
    assert [c["loss_scale"] for c in full] == [2.0**15, 2.0**14, 2.0**13, 4096.0, 4096.0, 8192.0, 8192.0, 16384.0]
    assert [c["skipped"] for c in full] == [True] * 3 + [False] * 4 + [True]
    stopped = two.agreed(f"{name}_stop")
    assert stopped == full[:SAVED]

    run = two.run_dir(f"{name}_stop")
    meta = json.loads((run / "checkpoints" / f"step_{SAVED:08d}" / "meta.json").read_text())
    assert meta["state"]["loss_scale"] == {"scale": 8192.0, "growth_tracker": 1, "hysteresis_tracker": 1}

    log = (one.out / "launch.log").read_text()
    assert f"{run / 'checkpoints' / f'step_{SAVED:08d}'} was saved at tp=" in log and "resharded" in log

    resumed = one.agreed(f"{name}_resumed")
    assert resumed == full[SAVED:], "the resumed run's updates differ from the uninterrupted run's"
    records = one.records(f"{name}_resumed")
    got = [r for r in records if r["step"] > SAVED]
    want = two.records(f"{name}_full")[SAVED:]
    assert [(r["step"], r["loss_scale"], r["skipped"]) for r in got] == [
        (r["step"], r["loss_scale"], r["skipped"]) for r in want]
    for g, w in zip(got, want):
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-3), f"step {g['step']}: {g['loss']} vs {w['loss']}"
