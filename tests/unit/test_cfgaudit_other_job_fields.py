"""A field the user sets that the configured job never reads is refused, naming the field and the job's own:
the lm job's ``train.steps`` etc. with job=rl (``rl.steps`` is what runs), the RL job's sections with job=lm.
The recipes' own values, and given values equal to the field's default, still pass."""

from __future__ import annotations

import pytest

from megatron_logra.config import RECIPES, parse_args_to_config


@pytest.mark.parametrize("recipe, override, message", [
    ("tiny", "train.steps=500", "train.steps is the lm job's; the RL job runs rl.steps"),
    ("tiny", "train.global_batch_size=7", "rl.prompts_per_step × rl.group_size"),
    ("tiny", "train.micro_batch_size=64", "rl.micro_batch_size"),
    ("tiny", "train.eval_interval=3", "rl.eval_interval"),
    ("tiny", "train.eval_sequences=10", "task.num_eval"),
    ("tiny", "data.content_length=4", "task."),
    ("lm-tiny", "rl.steps=5", "rl.steps is the RL job's; the lm job runs train.steps"),
    ("lm-tiny", "rl.rollout.temperature=0.5", "train."),
    ("lm-tiny", "sync.mode=full", "sync.mode"),
    ("lm-tiny", "task.num_eval=3", "data."),
])
def test_a_field_the_job_does_not_read_is_refused(recipe, override, message):
    with pytest.raises(ValueError) as info:
        parse_args_to_config(recipe, [override])
    assert message in str(info.value)
    assert f"{override.split('=')[0]}=" in str(info.value)


def test_a_recipe_file_field_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("recipe: tiny\ntrain:\n  steps: 500\n")
    with pytest.raises(ValueError, match=r"train\.steps=500 is set in recipe file .*r\.yaml"):
        parse_args_to_config(str(path), [])


def test_defaults_flags_and_the_job_own_fields_pass():
    assert parse_args_to_config("tiny", ["train.steps=300"]).rl.steps == 60  # the default: nothing is lost
    assert parse_args_to_config("tiny", ["--train-iters", "5"]).rl.steps == 5
    assert parse_args_to_config("lm-tiny", ["--train-iters", "5"]).train.steps == 5
    assert parse_args_to_config("tiny", ["job=lm"]).job == "lm"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_loads(name):
    assert parse_args_to_config(name, []).job in ("rl", "lm")


def test_example_yaml_loads():
    """Every example YAML file loads, and the config it gives holds each value the file sets."""
    from pathlib import Path

    import yaml

    def leaves(node, prefix=()):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from leaves(value, (*prefix, key))
            else:
                yield (*prefix, key), value

    paths = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    assert paths, "no example YAML files found"
    for path in paths:
        cfg = parse_args_to_config(str(path), [])
        given = [(keys, value) for keys, value in leaves(yaml.safe_load(path.read_text())) if keys != ("recipe",)]
        assert given, path
        for keys, value in given:
            node = cfg
            for key in keys:
                node = getattr(node, key)
            assert node == value, (path.name, ".".join(keys), node, value)
