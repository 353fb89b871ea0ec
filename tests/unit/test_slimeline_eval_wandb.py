"""The fields slime's ``--eval-top-p`` and ``--wandb-group`` set reach what they configure: the held-out
evaluation's nucleus sampling (``rl.rollout.eval_top_p``) and the W&B run's group (``train.wandb_group``)."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config


def test_eval_top_p_reaches_the_held_out_sampling(tmp_path, monkeypatch):
    """A nucleus of almost no mass keeps only the most likely token: sampling at a high temperature then answers
    exactly as greedy decoding does, while the same temperature without the nucleus does not."""
    from megatron_logra.rl.evaluation import evaluate_held_out
    from support.run_fixtures import rl_components

    with rl_components(tmp_path / "run", ["rl.steps=1", "rl.prompts_per_step=4", "rl.group_size=2",
                                          "task.num_eval=24"]) as (comps, _):
        seen: list[str] = []

        def score(problem, completion):
            seen.append(completion)
            return 0.0, False

        monkeypatch.setattr(comps.task, "score", score)

        def answers(temperature: float, top_p: float) -> list[str]:
            monkeypatch.setattr(comps.cfg.rl.rollout, "eval_temperature", temperature)
            monkeypatch.setattr(comps.cfg.rl.rollout, "eval_top_p", top_p)
            seen.clear()
            evaluate_held_out(comps)
            return list(seen)

        greedy = answers(0.0, 1.0)
        assert len(greedy) == 24
        assert answers(3.0, 1e-6) == greedy
        assert answers(3.0, 1.0) != greedy


def test_wandb_group_names_the_runs_group(tmp_path, monkeypatch, capsys, one_thread):
    pytest.importorskip("wandb")
    from megatron_logra.cli import main
    from tests.support.wandb_records import offline_runs, read_offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=1", "train.progress=false",
                 "train.eval_sequences=4", "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64",
                 "logra.rank=4", "--wandb-project", "logra-tests", "--wandb-group", "sweep-7"]) == 0
    capsys.readouterr()
    (files,) = offline_runs(run)
    logged = read_offline_run(files)
    assert (logged["project"], logged["group"]) == ("logra-tests", "sweep-7")
    with pytest.raises(ValueError, match=r"train\.wandb_group set without train\.wandb_project"):
        parse_args_to_config("lm-tiny", ["--wandb-group", "sweep-7"])
