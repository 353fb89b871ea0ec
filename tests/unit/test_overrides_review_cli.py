"""Config-time refusals of settings that used to be accepted and then silently ignored or misread:

* ``optimizer.name=adam`` (dense AdamW) with ``native.freeze=true`` or, for RL, ``kl.mode`` other than
  ``none``: dense AdamW reads neither, so the run was uncontrolled and trained the frozen parameters;
* in a recipe file, architecture fields that ``model.hf_path``'s checkpoint replaces (refused on the
  command line already) and a key given twice in one mapping (PyYAML keeps the last, dropping a section);
* ``sync.max_master_drift`` NaN / inf (no drift ever exceeds them: the re-anchor was off);
* an empty ``train.run_dir`` (the run wrote into, and ``train.overwrite`` deleted from, the working directory).
"""

from __future__ import annotations


import pytest

from megatron_logra.cli import main
from megatron_logra.config import load_recipe, parse_args_to_config
from support.run_fixtures import tiny_llama_dir

@pytest.fixture
def hf_dir(tmp_path):
    return tiny_llama_dir(tmp_path)


# ---------------------------------------------------------------- dense AdamW and LoGRA-only settings
def test_dense_adamw_with_kl_control_or_frozen_parameters_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"optimizer\.name=adam does not read optimizer\.native\.freeze=true .*"
                                         r"set native\.freeze=false.* or kl\.mode=calibrated .*set kl\.mode=none"):
        parse_args_to_config("tiny", ["--optimizer", "adam"])
    with pytest.raises(ValueError, match=r"kl\.mode=predicted .*set kl\.mode=none"):
        parse_args_to_config("tiny", ["optimizer.name=adam", "native.freeze=false", "kl.mode=predicted"])
    with pytest.raises(ValueError, match=r"optimizer\.native\.freeze=true"):
        parse_args_to_config("lm-tiny", ["optimizer.name=adam", "native.freeze=true"])


def test_dense_adamw_runs_that_read_every_setting_are_accepted():
    assert parse_args_to_config("tiny-adam", []).optimizer.name == "adam"
    assert parse_args_to_config("lm-tiny-adam", []).optimizer.name == "adam"
    assert parse_args_to_config("lm-tiny", ["optimizer.name=adam"]).optimizer.name == "adam"  # no KL in the lm job
    cfg = parse_args_to_config("tiny", ["--optimizer", "adam", "kl.mode=none", "native.freeze=false", "--lr", "0.25"])
    assert (cfg.optimizer.name, cfg.kl.mode, cfg.optimizer.native.lr) == ("adam", "none", 0.25)
    # the memory planner's dense comparison of a large recipe, made explicit
    big = parse_args_to_config("27b", ["optimizer.name=adam", "native.freeze=false", "kl.mode=none"])
    assert big.optimizer.name == "adam"


def test_the_cli_refuses_dense_adamw_with_kl_control_with_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "tiny", "optimizer.name=adam"])
    assert info.value.code == 2 and "kl.mode=none" in capsys.readouterr().err


# ---------------------------------------------------------------- recipe files
def test_a_recipe_files_architecture_fields_replaced_by_hf_path_are_refused(hf_dir, tmp_path):
    path = tmp_path / "hf.yaml"
    path.write_text(f"recipe: tiny\nmodel:\n  hf_path: {hf_dir}\n  num_layers: 3\n  hidden_size: 96\n")
    want = (r"model\.num_layers=3 \(set in recipe file .*hf\.yaml; the checkpoint has 2\); model\.hidden_size=96 "
            r"\(set in recipe file .*hf\.yaml; the checkpoint has 64\).*model\.hf_path")
    with pytest.raises(ValueError, match=want):
        load_recipe(str(path))
    with pytest.raises(ValueError, match=want):
        parse_args_to_config(str(path), [])
    # fields equal to the checkpoint's, or put right on the command line, are fine
    path.write_text(f"recipe: tiny\nmodel:\n  hf_path: {hf_dir}\n  num_layers: 2\n  hidden_size: 96\n")
    assert parse_args_to_config(str(path), ["model.hidden_size=64"]).model.hidden_size == 64


def test_a_recipe_files_architecture_fields_are_refused_with_hf_path_given_later(hf_dir, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("recipe: tiny\nmodel: {num_layers: 3}\n")
    child = tmp_path / "child.yaml"
    child.write_text(f"recipe: base.yaml\nmodel: {{hf_path: {hf_dir}}}\n")
    with pytest.raises(ValueError, match=r"model\.num_layers=3 \(set in recipe file .*base\.yaml; the checkpoint "
                                         r"has 2\)"):
        load_recipe(str(child))
    with pytest.raises(ValueError, match=r"model\.num_layers=3 \(set in recipe file .*base\.yaml"):
        parse_args_to_config(str(base), [f"model.hf_path={hf_dir}"])
    # a named recipe's preset shapes are replaced by design
    assert parse_args_to_config("qwen2.5-1.5b", [f"model.hf_path={hf_dir}"]).model.hidden_size == 64


@pytest.mark.parametrize("text, key, lines", [
    ("recipe: lm-tiny\ntrain:\n  steps: 40\n  run_dir: runs/exp-a\noptimizer:\n  logra:\n    rank: 8\n"
     "train:\n  save_interval: 10\n", "train", (2, 8)),
    ("recipe: lm-tiny\ntrain:\n  steps: 40\n  steps: 50\n", "steps", (3, 4)),
    ("recipe: lm-tiny\noptimizer: {logra: {rank: 8, rank: 4}}\n", "rank", (2, 2)),
])
def test_a_key_given_twice_in_a_recipe_file_is_refused(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"recipe file .*dup\.yaml: key '{key}' appears twice in one mapping "
                                         rf"\(lines {lines[0]} and {lines[1]}\)"):
        load_recipe(str(path))


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("recipe: lm-tiny\ntrain:\n  <<: {steps: 7, save_interval: 3}\n  steps: 9\n")
    cfg = load_recipe(str(path))
    assert (cfg.train.steps, cfg.train.save_interval) == (9, 3)


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_master_drift_is_refused(value):
    with pytest.raises(ValueError, match=rf"sync\.max_master_drift={value} must be a finite number >= 0"):
        parse_args_to_config("tiny", [f"sync.max_master_drift={value}"])
    assert parse_args_to_config("tiny", ["sync.max_master_drift=0"]).sync.max_master_drift == 0.0


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_run_dir_is_refused(value):
    with pytest.raises(ValueError, match=r"train\.run_dir='\s*' is empty.*train\.run_dir=runs/"):
        parse_args_to_config("lm-tiny", [f"train.run_dir={value}"])
    with pytest.raises(ValueError, match=r"train\.run_dir"):
        parse_args_to_config("tiny", ["--save", value])
