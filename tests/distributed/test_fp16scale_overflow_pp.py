"""A float16 overflow forced under pipeline parallelism: every stage skips (LM job) or re-runs (RL job) together.

A loss scale of 2**17 overflows float16 at once (the loss is a sum over the step's tokens). With
``optimizer.loss_scale.window=1`` and ``hysteresis=1`` the scale halves at every overflow and doubles after every
step that fits, so after coming down it keeps probing its limit, and near the limit one stage overflows alone
(measured: the last stage in the LM jobs, the first in the RL job): each stage's optimizer must reduce the
overflow flag over the model-parallel group, so that both skip the update and lower the scale together. A stage that decided alone would apply an update
the other skipped (the LM job) or leave the RL job's re-run loop while the other runs the forward/backward again,
and the next collective would hang (the jobs run with ``parallel.timeout_minutes=2``, so a hang fails the launch
instead of the test session).

Jobs, on 2 ranks at PP 2, on 4 at TP 2 x PP 2, and in one process for reference:

* lm-tiny ``--fp16`` (LoGRA) and lm-tiny-adam ``--fp16`` (dense AdamW), 12 steps: the first 5 are skipped
  (2**17 down to 8192) and 4096 fits; later steps overflow again at 16384 or 8192, some on the last stage only;
* the tiny RL recipe ``--fp16``, 3 steps, with ``rl.max_bad_steps=1`` (an overflow is not a bad step): its first
  step re-runs on the same rollouts until 512 fits, and the later steps re-run where the doubled scale overflows.

Every rank records each of its ``prepare`` calls (``fp16scale_jobs_worker.py``); they must be the same on every
rank and the same as one process's, and some overflow must have been on one stage only (else the check would
not need the reduction). PP splits no reduction, so the LM losses are bitwise those of one process.
"""

from __future__ import annotations

import math

import pytest

from fp16scale_jobs_worker import COMMON_LM, COMMON_RL, run_jobs

pytestmark = pytest.mark.distributed

SCALE = [f"optimizer.loss_scale.initial={2.0**17}", "optimizer.loss_scale.window=1", "optimizer.loss_scale.hysteresis=1"]
LM = ["lm-tiny", "--fp16", "train.steps=12", *COMMON_LM, *SCALE]
ADAM = ["lm-tiny-adam", "--fp16", "train.steps=12", *COMMON_LM, *SCALE]
RL = ["tiny", "--fp16", "rl.steps=3", *COMMON_RL, *SCALE, "rl.max_bad_steps=1"]
PP2 = ["parallel.pp=2"]


@pytest.fixture(scope="module")
def one(launcher, tmp_path_factory):
    return run_jobs(launcher, 1, tmp_path_factory.mktemp("one"), {"lm": LM, "adam": ADAM, "rl": RL})


@pytest.fixture(scope="module")
def two(launcher, tmp_path_factory):
    return run_jobs(launcher, 2, tmp_path_factory.mktemp("pp2"),
                    {"lm": [*LM, *PP2], "adam": [*ADAM, *PP2], "rl": [*RL, *PP2]}, timeout=400)


@pytest.fixture(scope="module")
def four(launcher, tmp_path_factory):
    return run_jobs(launcher, 4, tmp_path_factory.mktemp("tp2pp2"), {"lm": [*LM, *PP2, "parallel.tp=2"]},
                    timeout=400)


def _follows_the_rules(calls: list[dict]) -> None:
    """window=1, hysteresis=1: every overflow halves the scale, every update that fits doubles it."""
    for c in calls:
        assert c["overflow"] == c["skipped"], c
        assert c["next_scale"] == c["loss_scale"] * (0.5 if c["overflow"] else 2.0), c
    for a, b in zip(calls, calls[1:]):
        assert b["loss_scale"] == a["next_scale"]


def _one_stage_only(runs, label: str) -> int:
    """How many prepares overflowed on some rank but not on all (before the flag's reduction)."""
    ranks = runs.prepares(label)
    return sum(len({r[i]["local_overflow"] for r in ranks}) > 1 for i in range(len(ranks[0])))


@pytest.mark.parametrize("job", ["lm", "adam"])
def test_every_stage_skips_the_overflowing_lm_steps_together(one, two, job):
    calls = two.agreed(job)
    assert [c["skipped"] for c in calls[:6]] == [True] * 5 + [False], calls
    assert calls[0]["loss_scale"] == 2.0**17
    _follows_the_rules(calls)
    assert any(c["skipped"] for c in calls[6:]), "no overflow after the first: the scale did not probe its limit"
    assert _one_stage_only(two, job) >= 1, "every overflow was on both stages: the reduction went unchecked"
    assert calls == one.agreed(job)
    got, want = two.records(job), one.records(job)
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in got] == [
        (r["step"], r["skipped"], r["loss_scale"]) for r in want]
    assert all("float16 overflow at loss scale" in r["skip_reason"] for r in got if r["skipped"])
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # no stage applied a skipped update


def test_every_stage_reruns_the_overflowing_rl_step_together(one, two):
    calls = two.agreed("rl")
    _follows_the_rules(calls)
    first = [c for c in calls if c["step"] == 1]
    assert len(first) >= 3 and not first[-1]["skipped"], "the step did not re-run: the check would be vacuous"
    assert _one_stage_only(two, "rl") >= 1, "every overflow was on both stages: the reduction went unchecked"
    assert calls == one.agreed("rl")
    got, want = two.records("rl"), one.records("rl")
    assert [(r["step"], r["skipped"], r["loss_scale"], r["overflow_retries"], r["reward_mean"]) for r in got] == [
        (r["step"], r["skipped"], r["loss_scale"], r["overflow_retries"], r["reward_mean"]) for r in want]
    assert got[0]["overflow_retries"] == len(first) - 1
    assert not any(r["skipped"] for r in got)
    for g, w in zip(got, want):
        assert math.isclose(g["loss"], w["loss"], rel_tol=0.0, abs_tol=1e-3), f"step {g['step']}"


def test_tp2_pp2_ranks_skip_together(one, four):
    calls = four.agreed("lm")
    assert calls == one.agreed("lm")
    got, want = four.records("lm"), one.records("lm")
    assert [(r["skipped"], r["loss_scale"]) for r in got] == [(r["skipped"], r["loss_scale"]) for r in want]
    for g, w in zip(got, want):  # TP splits the row-parallel sums (test_fp16scale_layouts.py)
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-3), f"step {g['step']}"
