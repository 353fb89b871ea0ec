"""float16 training with dynamic loss scaling under TP 2, PP 2 and DP 2 (2 gloo ranks) against one process.

The overflow flag is reduced over the model-parallel group (and, being computed after the data-parallel
reduction of the sketches and gradients, is the same on every DP replica), so every rank must prepare the same
updates: the same loss scale, the same skipped (LM job) or re-run (RL job) steps, the same next scale. That is
checked from each rank's own record of its ``prepare`` calls (``fp16scale_jobs_worker.py``), not from rank 0's
metrics.jsonl alone.

* LM job (lm-tiny ``--fp16``, 8 sequences a step, no dropout), started at scale 2**15 with ``window=2`` and
  ``hysteresis=1``: its first 3 steps overflow and are skipped (the scale halves each time) until 4096 fits;
  every 2 steps without an overflow double it, and 16384 overflows again at step 8. Every layout takes these decisions as one process does.
  PP 2 splits no reduction (as in ``test_parallel_equivalence.py``) and the stages pass float16 activations as
  one process computes them, so its losses are bitwise those of one process (its grad norm sums the stages'
  squares in another order: to the last digit). TP 2 splits the row-parallel inner products and DP 2 the
  sketch's token sum: losses to ``rtol=1e-3`` (float16's resolution, 2**-10; measured ≤ 1e-5), grad norms
  to ``rtol=1e-2`` (measured ≤ 6e-5).
* RL job (the tiny recipe ``--fp16``, 4 prompts x 4 samples): its first step overflows at the default 4096
  and re-runs its forward/backward on the same rollouts until 512 fits (4 re-runs). TP 2 and PP 2 draw the
  same rollouts as one process (the same rewards) and so re-run the same times at the same scales; their losses
  agree to ``1e-3`` (absolute: the RL loss is a difference of terms of order 1) and grad norms to ``rtol=1e-2``
  (measured ≤ 6e-5 and 3e-3: under PP the KL probe is the finite-difference one, whose step size changes the
  second update slightly). DP 2 gives each rank its own rollouts: the ranks must still agree, and every re-run
  of the step shows in ``overflow_retries``.
"""

from __future__ import annotations

import math

import pytest

from fp16scale_jobs_worker import COMMON_LM, COMMON_RL, run_jobs

pytestmark = pytest.mark.distributed

LM = ["lm-tiny", "--fp16", "train.steps=8", *COMMON_LM, f"optimizer.loss_scale.initial={2.0**15}",
      "optimizer.loss_scale.window=2", "optimizer.loss_scale.hysteresis=1"]
RL = ["tiny", "--fp16", "rl.steps=2", *COMMON_RL]
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": []}

LOSS_RTOL = 1e-3
GNORM_RTOL = 1e-2
RL_LOSS_ATOL = 1e-3


@pytest.fixture(scope="module")
def one(launcher, tmp_path_factory):
    return run_jobs(launcher, 1, tmp_path_factory.mktemp("one"), {"lm": LM, "rl": RL})


@pytest.fixture(scope="module")
def two(launcher, tmp_path_factory):
    jobs = {**{f"lm_{name}": [*LM, *extra] for name, extra in LAYOUTS.items()},
            **{f"rl_{name}": [*RL, *extra] for name, extra in LAYOUTS.items()}}
    return run_jobs(launcher, 2, tmp_path_factory.mktemp("two"), jobs, timeout=400)


def _decisions(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss_scale"], r["skipped"], r.get("overflow_retries")) for r in records]


def test_one_process_lm_run_overflows_skips_and_grows(one):
    calls = one.agreed("lm")
    scales = [c["loss_scale"] for c in calls]
    skipped = [c["skipped"] for c in calls]
    # 2**15, 2**14, 2**13 overflow; 4096 fits twice and doubles, 8192 twice and doubles, 16384 overflows
    assert scales == [2.0**15, 2.0**14, 2.0**13, 4096.0, 4096.0, 8192.0, 8192.0, 16384.0]
    assert skipped == [True, True, True, False, False, False, False, True]
    assert all(c["overflow"] == c["skipped"] for c in calls)
    assert [r["loss_scale"] for r in one.records("lm")] == scales


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lm_layout_takes_the_one_process_decisions(one, two, layout):
    label = f"lm_{layout}"
    assert two.agreed(label) == one.agreed("lm"), f"{label}: the ranks decided otherwise than one process"
    got, want = two.records(label), one.records("lm")
    assert _decisions(got) == _decisions(want)
    for g, w in zip(got, want):
        if layout == "pp2":  # no reduction split: the same weights, bitwise the same losses
            assert g["loss"] == w["loss"], f"step {g['step']}: {g['loss']!r} vs {w['loss']!r}"
        assert math.isclose(g["loss"], w["loss"], rel_tol=LOSS_RTOL), f"step {g['step']}: {g['loss']} vs {w['loss']}"
        if not w["skipped"]:
            assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=GNORM_RTOL), f"step {g['step']}"


def test_one_process_rl_run_reruns_its_first_step(one):
    calls = one.agreed("rl")
    first = [c for c in calls if c["step"] == 1]
    assert [c["loss_scale"] for c in first] == [4096.0, 4096.0, 2048.0, 1024.0, 512.0]
    assert [c["overflow"] for c in first] == [True] * 4 + [False]
    records = one.records("rl")
    assert [(r["step"], r["loss_scale"], r["overflow_retries"], r["skipped"]) for r in records] == [
        (1, 512.0, 4, False), (2, 512.0, 0, False)]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_rl_layout_reruns_as_one_process(one, two, layout):
    label = f"rl_{layout}"
    assert two.agreed(label) == one.agreed("rl")
    got, want = two.records(label), one.records("rl")
    assert _decisions(got) == _decisions(want)
    for g, w in zip(got, want):
        assert g["reward_mean"] == w["reward_mean"], "not the same rollouts: the comparison would be vacuous"
        assert math.isclose(g["loss"], w["loss"], rel_tol=0.0, abs_tol=RL_LOSS_ATOL), f"step {g['step']}"
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=GNORM_RTOL), f"step {g['step']}"


def test_rl_data_parallel_ranks_rerun_together(two):
    calls = two.agreed("rl_dp2")
    records = two.records("rl_dp2")
    assert [r["step"] for r in records] == [1, 2] and not any(r["skipped"] for r in records)
    assert sum(r["overflow_retries"] for r in records) >= 1, "nothing overflowed: the check would be vacuous"
    for r in records:  # every re-run of the step is one overflowing prepare, on every rank
        runs = [c for c in calls if c["step"] == r["step"]]
        assert [c["overflow"] for c in runs] == [True] * r["overflow_retries"] + [False]
        assert runs[-1]["loss_scale"] == r["loss_scale"]
