"""Profiling settings on a resumed run: a diagnostic, so ``train.resume=true`` with a recipe (a bare ``--resume``)
may profile other steps than the run saved, or none, as ``--resume RUN_DIR profile.*=...`` may."""

from __future__ import annotations

import pytest

from megatron_logra.cli.resume import check_recipe_resume, resume_differences
from megatron_logra.config import parse_args_to_config, to_dict
from support.run_fixtures import run_recipe

COMMON = ["train.eval_interval=0", "train.progress=false", "train.eval_sequences=16"]


def test_profile_fields_are_launch_settings_for_a_recipe_resume():
    saved = to_dict(parse_args_to_config("lm-tiny", ["train.steps=10", "--profile", "profile.ranks=0"]))
    cfg = parse_args_to_config("lm-tiny", ["train.steps=20", "profile.tool=torch", "--profile-step-start", "12",
                                           "--profile-step-end", "14", "--pytorch-profiler-collect-shapes"])
    assert resume_differences(saved, cfg) == []
    # the run's own settings are still compared
    other = parse_args_to_config("lm-tiny", ["train.steps=20", "--seed", "7", "--profile"])
    assert [name for name, _, _ in resume_differences(saved, other)] == ["train.seed"]


def test_bare_resume_of_a_saved_run_profiles_the_steps_it_now_asks_for(tmp_path, one_thread):
    run = tmp_path / "run"

    def train(overrides: list[str]) -> dict:  # with what `train` checks before the job: no profile.* refused
        return run_recipe("lm-tiny", COMMON + [f"train.run_dir={run}"] + overrides, check_resume=True)

    train(["train.steps=2"])
    summary = train(["train.steps=4", "--resume", "--profile", "--profile-step-start", "3", "--profile-step-end", "5"])
    assert summary["steps"] == 4
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0-steps3-4.json.gz", "rank0-steps3-4.txt"]
    with pytest.raises(ValueError, match=r"train\.seed: 1234 saved, 7 given"):
        check_recipe_resume(parse_args_to_config("lm-tiny", COMMON + [f"train.run_dir={run}", "train.steps=6",
                                                                     "--resume", "--seed", "7", "--profile"]))
