"""Bad config input (overrides, recipe YAML files, a run's saved config.yaml) is a ValueError naming the field
or file and the fix, never a traceback from deep inside training."""

from __future__ import annotations


import pytest
from support import forked
import yaml

from megatron_logra.config import RunConfig, from_dict, to_dict, load_recipe, parse_args_to_config


# ---------------------------------------------------------------- 1. a whole section set to a scalar / list
@pytest.mark.parametrize("override, key", [
    ("rl.rollout=3", "rl.rollout"),
    ("rl=5", "rl"),
    ("--rl.rollout", "rl.rollout"),
    ("logra=4", "optimizer.logra"),
    ("optimizer.native=[1,2]", "optimizer.native"),
])
def test_override_of_a_section_is_refused(override, key):
    args = [override, "3"] if override.startswith("--") else [override]
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')} is a section.*{key.replace('.', '[.]')}[.]<field>="):
        parse_args_to_config("tiny", args)


@pytest.mark.parametrize("body, key", [
    ("rl: 5\n", "rl"),
    ("rl: [1, 2]\n", "rl"),
    ("rl:\n  rollout: 3\n", "rl.rollout"),
    ("rl:\n  rollout:\n", "rl.rollout"),
])
def test_yaml_recipe_setting_a_section_to_a_value_is_refused(tmp_path, body, key):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: lm-tiny\n" + body)
    with pytest.raises(ValueError, match=rf"{path.name}.*{key.replace('.', '[.]')} is a section"):
        load_recipe(str(path))


def test_from_dict_section_set_to_a_value_is_refused():
    with pytest.raises(ValueError, match=r"rl[.]rollout is a section"):
        from_dict(RunConfig, {"rl": {"rollout": 3}})
    with pytest.raises(ValueError, match=r"rl is a section"):
        from_dict(RunConfig, {"rl": 5})


def test_cli_config_with_a_section_override_exits_2_with_a_message():
    proc = forked.python(["-m", "megatron_logra.cli", "config", "tiny", "rl.rollout=3"], timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "rl.rollout is a section" in proc.stderr and "rl.rollout.<field>=" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- 2. recipe files: not a mapping, bad YAML, missing
@pytest.mark.parametrize("body, problem", [
    ("- a\n- b\n", "top level must be a mapping"),
    ("5\n", "top level must be a mapping"),
    ("train: {steps: 3\n", "not valid YAML"),
    ("train:\n  steps: 3\n   bad: 1\n", "not valid YAML"),
    ("recipe: 5\n", "recipe"),
])
def test_bad_recipe_files_name_the_file(tmp_path, body, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=problem) as info:
        load_recipe(str(path))
    assert str(path) in str(info.value)


def test_missing_recipe_file_says_it_does_not_exist(tmp_path):
    for name in (str(tmp_path / "nonexist.yaml"), str(tmp_path / "nonexist.yml")):
        with pytest.raises(ValueError, match="does not exist") as info:
            load_recipe(name)
        assert name in str(info.value) and "unknown recipe" not in str(info.value)
    with pytest.raises(ValueError, match="unknown recipe"):
        load_recipe("nope")


def test_recipe_files_that_include_each_other_are_refused(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"recipe: {b}\n")
    b.write_text(f"recipe: {a}\n")
    with pytest.raises(ValueError, match="include"):
        load_recipe(str(a))


def test_yaml_recipe_values_keep_their_types(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: tiny\nrl:\n  rollout:\n    sglang_engine_args: {mem_fraction_static: 0.5}\n"
                    "task:\n  datasets: [chain_sum, gcd]\n  weights: [1, 3]\n  dataset_kwargs: {gcd: {max_value: 9}}\n"
                    "optimizer:\n  logra:\n    lr: 1e-4\n")
    cfg = load_recipe(str(path))
    assert cfg.rl.rollout.sglang_engine_args == {"mem_fraction_static": 0.5}
    assert cfg.task.datasets == ["chain_sum", "gcd"] and cfg.task.weights == [1.0, 3.0]
    assert cfg.task.dataset_kwargs == {"gcd": {"max_value": 9}} and cfg.optimizer.logra.lr == pytest.approx(1e-4)


# ---------------------------------------------------------------- 3. from_dict (a run's saved config.yaml) checks types
@pytest.mark.parametrize("patch, key, problem", [
    ({"train": {"steps": "abc"}}, "train.steps", "not an integer"),
    ({"optimizer": {"logra": {"rank": [32]}}}, "optimizer.logra.rank", "not an integer"),
    ({"optimizer": {"logra": {"lr": "fast"}}}, "optimizer.logra.lr", "not a number"),
    ({"optimizer": {"logra": {"refresh": "maybe"}}}, "optimizer.logra.refresh", "not a boolean"),
    ({"train": {"steps": True}}, "train.steps", "not an integer"),
    ({"train": {"steps": None}}, "train.steps", "not an integer"),
    ({"task": {"datasets": 5}}, "task.datasets", "not a list"),
    ({"task": {"dataset_kwargs": [1]}}, "task.dataset_kwargs", "not a mapping"),
])
def test_from_dict_rejects_values_of_the_wrong_type(patch, key, problem):
    data = to_dict(load_recipe("tiny"))
    for section, fields in patch.items():
        target = data[section]
        while any(isinstance(v, dict) for v in fields.values()):
            (sub, fields), = fields.items()
            target = target[sub]
        target.update(fields)
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}.*{problem}"):
        from_dict(RunConfig, data)


def test_from_dict_coerces_like_the_overrides():
    data = to_dict(load_recipe("tiny"))
    data["optimizer"]["logra"]["rank"] = "16"
    data["optimizer"]["logra"]["lr"] = "1e-4"   # YAML 1.1 reads 1e-4 as a string
    data["train"]["steps"] = 5
    cfg = from_dict(RunConfig, yaml.safe_load(yaml.safe_dump(data)))
    assert cfg.optimizer.logra.rank == 16 and cfg.optimizer.logra.lr == pytest.approx(1e-4) and cfg.train.steps == 5
    assert to_dict(from_dict(RunConfig, to_dict(cfg))) == to_dict(cfg)


@pytest.mark.parametrize("data", [None, [1, 2], "text", 5])
def test_from_dict_of_a_non_mapping_is_refused(data):
    with pytest.raises(ValueError, match="mapping"):
        from_dict(RunConfig, data)


def test_recipe_file_includes_resolve_relative_to_the_including_file(tmp_path, monkeypatch):
    sub = tmp_path / "recipes"
    sub.mkdir()
    (sub / "base.yaml").write_text("recipe: lm-tiny\ntrain:\n  steps: 7\n")
    (sub / "child.yaml").write_text("recipe: base.yaml\noptimizer:\n  logra:\n    rank: 4\n")
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_recipe(str(sub / "child.yaml"))
    assert cfg.train.steps == 7 and cfg.optimizer.logra.rank == 4 and cfg.job == "lm"
    (sub / "named.yaml").write_text("recipe: lm-tiny\n")  # recipe names still work
    assert load_recipe(str(sub / "named.yaml")).job == "lm"
    (sub / "missing.yaml").write_text("recipe: nope.yaml\n")
    with pytest.raises(ValueError, match=r"recipe file .*recipes/nope\.yaml does not exist"):
        load_recipe(str(sub / "missing.yaml"))
