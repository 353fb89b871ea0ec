"""``task.datasets`` overridden on a recipe whose ``task.dataset_kwargs`` are for its own datasets (the ``tiny``
recipe's chain_sum kwargs): the kwargs of datasets no longer listed are dropped, so another reasoning-gym
dataset or a JSONL file just works; kwargs the user gives for a dataset not listed are still refused, naming
the field and the fix."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

TINY_CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(40)))
    return path


def test_the_recipe_kwargs_really_are_for_chain_sum():
    from megatron_logra.config import parse_args_to_config

    task = parse_args_to_config("tiny", []).task
    assert task.datasets == ["chain_sum"] and task.dataset_kwargs == {"chain_sum": TINY_CHAIN_SUM}


def test_config_tiny_with_another_gym_dataset_works(capsys, caplog):
    from megatron_logra.cli import main

    with caplog.at_level(logging.INFO, logger="megatron_logra.config.overrides"):
        # gcd prompts are ~85 tokens: config refuses the recipe's model.seq_length=48 as train does
        assert main(["config", "tiny", "task.datasets=gcd", "model.seq_length=128"]) in (0, None)
    task = yaml.safe_load(capsys.readouterr().out)["task"]
    assert task["datasets"] == ["gcd"] and task["dataset_kwargs"] == {}
    assert "chain_sum" in caplog.text and "dropping task.dataset_kwargs" in caplog.text


def test_a_jsonl_file_on_the_tiny_recipe_builds_its_task(jsonl):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rewards import build_task

    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{jsonl}", "task.num_eval=2"])
    assert cfg.task.dataset_kwargs == {}
    task = build_task(cfg.task)
    assert task.train_problem(0).prompt.startswith("What is ") and len(task.eval_problems()) <= 2


def test_kwargs_of_datasets_still_listed_are_kept_and_a_recipe_file_drops_the_others(tmp_path):
    from megatron_logra.config import parse_args_to_config

    both = parse_args_to_config("tiny", ["task.datasets=gcd,chain_sum"]).task
    assert both.datasets == ["gcd", "chain_sum"] and both.dataset_kwargs == {"chain_sum": TINY_CHAIN_SUM}
    recipe = tmp_path / "gcd.yaml"
    recipe.write_text("recipe: tiny\ntask:\n  datasets: [gcd]\n")
    assert parse_args_to_config(str(recipe), []).task.dataset_kwargs == {}


def test_a_resumed_runs_config_with_another_dataset_drops_its_kwargs():
    from megatron_logra.config import apply_overrides, load_recipe

    cfg = apply_overrides(load_recipe("tiny"), ["task.datasets=gcd"])
    assert cfg.task.datasets == ["gcd"] and cfg.task.dataset_kwargs == {}


def test_kwargs_given_for_a_dataset_not_listed_are_refused_naming_the_fix():
    from megatron_logra.config import parse_args_to_config

    with pytest.raises(ValueError) as info:
        parse_args_to_config("tiny", ["task.datasets=gcd", f"task.dataset_kwargs={json.dumps({'chain_sum': {}})}"])
    msg = str(info.value)
    assert "task.dataset_kwargs['chain_sum']" in msg and "task.dataset_kwargs={}" in msg
    with pytest.raises(ValueError, match=r"task.dataset_kwargs=\{\}"):
        parse_args_to_config("tiny", ['task.dataset_kwargs={"gcd": {}}'])  # gcd is not listed
