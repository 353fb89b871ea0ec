"""Profiling a real job: the window's trace holds the job's phases, and the run's numbers do not change."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from support.run_fixtures import run_recipe


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _trace_names(path: Path) -> set[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name") for e in events if isinstance(e, dict)}


def _run_lm(overrides: list[str]) -> dict:
    return run_recipe("lm-tiny", overrides)


def test_lm_job_profiles_its_window_and_trains_the_same(tmp_path, one_thread):
    common = ["train.steps=4", "train.eval_interval=0", "train.progress=false", "train.eval_sequences=16"]
    _run_lm(common + [f"train.run_dir={tmp_path / 'plain'}"])
    _run_lm(common + [f"train.run_dir={tmp_path / 'prof'}", "--profile", "--profile-step-start", "2",
                      "--profile-step-end", "4"])
    files = sorted(p.name for p in (tmp_path / "prof" / "profile").iterdir())
    assert files == ["rank0-steps2-3.json.gz", "rank0-steps2-3.txt"]
    names = _trace_names(tmp_path / "prof" / "profile" / "rank0-steps2-3.json.gz")
    assert {"lm/data", "lm/forward_backward", "lm/prepare", "lm/apply"} <= names
    assert not (tmp_path / "plain" / "profile").exists()
    keys = ("step", "loss", "grad_norm", "lr")
    plain, prof = _metrics(tmp_path / "plain"), _metrics(tmp_path / "prof")
    assert [{k: r[k] for k in keys} for r in plain] == [{k: r[k] for k in keys} for r in prof]


def test_a_rank_the_job_lacks_is_refused_before_the_build(tmp_path, one_thread):
    with pytest.raises(ValueError, match=r"profile.ranks=\[0, 3\]: the job has 1 rank"):
        _run_lm([f"train.run_dir={tmp_path / 'r'}", "train.steps=2", "profile.enabled=true", "profile.ranks=0,3"])
    assert not (tmp_path / "r" / "config.yaml").exists()


def test_rl_job_profiles_its_phases_and_trains_the_same(tmp_path, one_thread):
    common = ["rl.steps=3", "rl.eval_interval=0", "task.num_eval=0", "train.progress=false"]
    run_recipe("tiny", common + [f"train.run_dir={tmp_path / 'plain'}"])
    run_recipe("tiny", common + [f"train.run_dir={tmp_path / 'prof'}", "profile.enabled=true",
                                    "profile.step_start=2", "profile.step_end=3"])
    trace = tmp_path / "prof" / "profile" / "rank0-steps2-2.json.gz"
    names = _trace_names(trace)
    story = {"rl/rollout", "rl/reward", "rl/advantage", "rl/forward_backward", "rl/prepare", "rl/kl_control",
             "rl/apply", "rl/sync"}
    assert story <= names, story - names
    keys = ("step", "reward_mean", "accuracy", "kl_predicted", "kl_actual", "alpha", "loss", "sync_bytes")
    plain, prof = _metrics(tmp_path / "plain"), _metrics(tmp_path / "prof")
    assert [{k: r.get(k) for k in keys} for r in plain] == [{k: r.get(k) for k in keys} for r in prof]


def test_lm_step_time_leaves_out_writing_the_trace(tmp_path, one_thread):
    """The window closes after its last step and writes the trace (seconds for a stack-recording one); that is
    not the step's time: step_seconds / tokens_per_second of that step stay those of a profiled step, as in the
    RL job's records."""
    run = tmp_path / "prof"
    _run_lm(["train.steps=4", "train.eval_interval=0", "train.progress=false", "train.eval_sequences=16",
             f"train.run_dir={run}", "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
             "profile.with_stack=true", "profile.record_shapes=true"])
    assert (run / "profile" / "rank0-steps2-3.json.gz").exists()
    seconds = {r["step"]: r["step_seconds"] for r in _metrics(run)}
    # step 3 closed the window (writing its trace took seconds here); step 2 was profiled alike, without writing
    assert seconds[3] < 3 * seconds[2] + 0.5, seconds
