"""``model.hf_path`` at config time: the RL job's config takes the checkpoint's architecture (as the job does
when it starts), so ``megatron-logra config`` prints what will be trained; a missing checkpoint, an
architecture override the checkpoint would replace and ``job=lm`` (which never reads it) are refused."""

from __future__ import annotations


import pytest
import yaml

from megatron_logra.cli import main
from megatron_logra.config import parse_args_to_config
from support.run_fixtures import tiny_llama_dir

@pytest.fixture
def hf_dir(tmp_path):
    return tiny_llama_dir(tmp_path, tokenizer=True)


def test_config_prints_the_checkpoint_architecture(hf_dir, capsys):
    assert main(["config", "tiny", f"model.hf_path={hf_dir}", "model.seq_length=96"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["num_layers"], model["hidden_size"], model["ffn_hidden_size"], model["num_query_groups"]) == (2, 64, 96, 2)
    assert model["rotary_base"] == 500000 and model["layernorm_epsilon"] == 1e-5
    assert model["seq_length"] == 96  # the run's own choice stays (the checkpoint's context is 4096)
    assert model["hf_path"] == str(hf_dir)


def test_a_missing_checkpoint_is_refused_at_config_time(tmp_path):
    with pytest.raises(ValueError, match=r"model\.hf_path='.*nowhere' is not a directory"):
        parse_args_to_config("tiny", [f"model.hf_path={tmp_path / 'nowhere'}"])


def test_an_architecture_override_the_checkpoint_replaces_is_refused(hf_dir):
    with pytest.raises(ValueError, match=r"model\.num_layers=3 \(the checkpoint has 2\).*model\.hf_path"):
        parse_args_to_config("tiny", [f"model.hf_path={hf_dir}", "--num-layers", "3"])
    assert parse_args_to_config("tiny", [f"model.hf_path={hf_dir}", "model.hidden_size=64"]).model.hidden_size == 64


def test_lm_job_refuses_hf_path(hf_dir, capsys):
    with pytest.raises(ValueError, match=r"model\.hf_path='.*' is not read by job=lm"):
        parse_args_to_config("lm-tiny", [f"model.hf_path={hf_dir}"])
    with pytest.raises(SystemExit) as info:
        main(["train", "lm-tiny", f"model.hf_path={hf_dir}"])
    assert info.value.code == 2 and "job=lm" in capsys.readouterr().err


def test_a_relative_hf_path_is_saved_absolute(hf_dir, monkeypatch, capsys):
    """A relative ``model.hf_path`` names the checkpoint against the launch directory: the config (and so the
    run's saved config.yaml) holds it absolute, so resuming or exporting from another directory finds it."""
    monkeypatch.chdir(hf_dir.parent)
    cfg = parse_args_to_config("tiny", [f"model.hf_path={hf_dir.name}"])
    assert cfg.model.hf_path == str(hf_dir)
    assert main(["config", "tiny", f"--model.hf_path=./{hf_dir.name}", "model.seq_length=96"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["hf_path"] == str(hf_dir)


def test_bare_resume_matches_a_config_saved_with_a_relative_hf_path(hf_dir, monkeypatch):
    """A run saved before ``model.hf_path`` was made absolute (its config.yaml holds the relative path) still
    matches the same recipe and overrides launched from the same directory."""
    from megatron_logra.cli import resume_differences
    from megatron_logra.config import to_dict

    monkeypatch.chdir(hf_dir.parent)
    cfg = parse_args_to_config("tiny", [f"model.hf_path={hf_dir.name}"])
    saved = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    saved["model"]["hf_path"] = hf_dir.name
    assert resume_differences(saved, cfg) == []
    saved["model"]["hf_path"] = "elsewhere"
    assert [d[0] for d in resume_differences(saved, cfg)] == ["model.hf_path"]
