"""``model.hf_path`` at config time: the RL job's config takes the checkpoint's architecture (as the job does
when it starts), so ``megatron-logra config`` prints what will be trained; a missing checkpoint, an
architecture override the checkpoint would replace and ``job=lm`` (which never reads it) are refused."""

from __future__ import annotations


import pytest
import yaml

from megatron_logra.cli import main
from megatron_logra.overrides import load_recipe, parse_args_to_config
from support.run_fixtures import tiny_llama_dir

@pytest.fixture
def hf_dir(tmp_path):
    return tiny_llama_dir(tmp_path)


def test_config_prints_the_checkpoint_architecture(hf_dir, capsys):
    assert main(["config", "tiny", f"model.hf_path={hf_dir}"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["num_layers"], model["hidden_size"], model["ffn_hidden_size"], model["num_query_groups"]) == (2, 64, 96, 2)
    assert model["rotary_base"] == 500000 and model["layernorm_epsilon"] == 1e-5
    assert model["seq_length"] == load_recipe("tiny").model.seq_length  # the run's own choice stays
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
