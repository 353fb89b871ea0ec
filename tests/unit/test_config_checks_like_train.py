"""``megatron-logra config`` refuses what ``train`` refuses at start, with the same error line and exit status 2:
the checks of the job that build nothing (the task's dataset names and kwargs, ``jsonl:`` files, a reward plugin,
the tokenizer of ``tokenizer.path`` or ``model.hf_path``), run by both commands through the same functions
(``megatron_logra.rl.job.check_config``); a config that passes them is printed as before, and nothing is written."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

from megatron_logra.cli import main
from support.run_fixtures import tiny_llama_dir
from support.scripts import exit_code

FAST = ["rl.steps=1", "sft.steps=0", "task.num_eval=2", "train.progress=false"]
"""A train run that got past its checks would stop after one step (it never should here)."""


def _error(capsys, argv) -> str:
    """The error line of ``main(argv)``, which must exit with status 2."""
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = exit_code(main, argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if line.startswith("megatron-logra: error: ")]
    assert lines, err
    return lines[-1]


def _config_and_train_agree(capsys, tmp_path, overrides) -> str:
    """``config tiny OVERRIDES`` and ``train tiny OVERRIDES`` (in ``tmp_path/run``) fail with the same error line;
    ``config`` writes nothing there. Returns the line."""
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"  # a new one each time: train claims it
    config = _error(capsys, ["config", "tiny", *overrides, f"train.run_dir={run}", *FAST])
    assert not run.exists()
    train = _error(capsys, ["train", "tiny", *overrides, f"train.run_dir={run}", *FAST])
    assert config == train
    return config


def _prints(capsys, overrides) -> dict:
    capsys.readouterr()
    assert main(["config", "tiny", *overrides]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_a_string_dataset_kwarg(capsys, tmp_path):
    bad = json.dumps({"chain_sum": {"min_terms": "2"}})
    line = _config_and_train_agree(capsys, tmp_path, [f"task.dataset_kwargs={bad}"])
    assert 'min_terms="2" is a JSON string' in line
    good = json.dumps({"chain_sum": {"min_terms": 2, "max_terms": 2}})
    assert _prints(capsys, [f"task.dataset_kwargs={good}"])["task"]["dataset_kwargs"]["chain_sum"]["min_terms"] == 2


@pytest.mark.parametrize("name, says", [("composite", "'composite' (reasoning-gym's dataset mixture) is not supported"),
                                        ("no_such_gym", "'no_such_gym' is not a reasoning-gym dataset")])
def test_a_dataset_the_task_builder_refuses(capsys, tmp_path, name, says):
    assert says in _config_and_train_agree(capsys, tmp_path, [f"task.datasets={name}"])


def test_a_missing_jsonl_file(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert "JSONL problem file not found" in _config_and_train_agree(capsys, tmp_path, [f"task.datasets=jsonl:{missing}"])


def test_a_malformed_jsonl_line(capsys, tmp_path):
    path = tmp_path / "problems.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(20)]
    path.write_text("\n".join(rows[:3] + ["{not json"] + rows[3:]) + "\n")
    line = _config_and_train_agree(capsys, tmp_path, [f"task.datasets=jsonl:{path}"])
    assert f"{path}:4: invalid JSON" in line
    path.write_text("\n".join(rows) + "\n")  # repaired: printed
    assert _prints(capsys, [f"task.datasets=jsonl:{path}"])["task"]["datasets"] == [f"jsonl:{path}"]


def test_a_tokenizer_path_without_a_tokenizer(capsys, tmp_path):
    empty = tmp_path / "tok"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a tokenizer\n")
    line = _config_and_train_agree(capsys, tmp_path, [f"tokenizer.path={empty}"])
    assert "holds no tokenizer files" in line
    # a path that does not exist at all: refused by both while the config is read
    assert _config_and_train_agree(capsys, tmp_path, [f"tokenizer.path={tmp_path / 'nowhere'}"]).endswith(
        "or '' for the built-in character tokenizer")


def test_a_model_hf_path_without_config_json_or_tokenizer(capsys, tmp_path):
    hf = tiny_llama_dir(tmp_path)  # config.json, no tokenizer files
    line = _config_and_train_agree(capsys, tmp_path, [f"model.hf_path={hf}", "model.seq_length=96"])
    assert f"tokenizer directory '{hf}' holds no tokenizer files" in line
    (hf / "config.json").unlink()
    line = _config_and_train_agree(capsys, tmp_path, [f"model.hf_path={hf}", "model.seq_length=96"])
    assert "no config.json" in line


def test_a_model_hf_path_with_its_tokenizer_prints(capsys, tmp_path):
    hf = tiny_llama_dir(tmp_path, tokenizer=True)
    assert _prints(capsys, [f"model.hf_path={hf}", "model.seq_length=96"])["model"]["vocab_size"] == 160
    # its character tokenizer spells the tiny task's prompts out: the recipe's model.seq_length=48 is too short
    assert "does not fit" in _config_and_train_agree(capsys, tmp_path, [f"model.hf_path={hf}"])


@pytest.mark.parametrize("reward, says", [("no_such_package_xyz.mod:score", "cannot import module"),
                                          ("json:no_such_function", "has no attribute 'no_such_function'")])
def test_a_reward_plugin_that_does_not_import(capsys, tmp_path, reward, says):
    line = _config_and_train_agree(capsys, tmp_path, [f"task.reward={reward}"])
    assert f"reward function {reward!r}" in line and says in line


def test_a_valid_config_is_printed_and_nothing_is_written(capsys, tmp_path):
    from megatron_logra.config import to_dict, parse_args_to_config
    from megatron_logra.rollout.sglang_setup import redact_config

    run = tmp_path / "run"
    overrides = ["task.datasets=gcd", "model.seq_length=128", f"train.run_dir={run}"]
    printed = _prints(capsys, overrides)
    assert printed == yaml.safe_load(yaml.safe_dump(redact_config(to_dict(parse_args_to_config("tiny", overrides)))))
    assert not run.exists()
