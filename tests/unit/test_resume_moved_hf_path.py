"""An RL run started from a Hugging Face checkpoint (``model.hf_path``), continued or evaluated where that
directory is not (the job moved to another cluster, the checkpoint moved): ``--resume`` and ``eval`` read it
again, so they are refused naming the saved path, what it is read for and the override that gives its new place,
``model.hf_path=DIR``, which then works. The refusal used to say only that the path "is not a directory
(expected a Hugging Face checkpoint)"."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from megatron_logra.cli.run_dir import run_dir_config
from megatron_logra.config import parse_args_to_config, to_dict
from support.run_fixtures import tiny_llama_dir


@pytest.fixture
def moved(tmp_path):
    """A run directory of ``tiny`` started from a two-layer Llama (its config.yaml and latest checkpoint's copy,
    ``RUN/tokenizer``), whose Hugging Face directory was then moved; returns (RUN, the new place)."""
    hf = tiny_llama_dir(tmp_path, tokenizer=True)
    run = tmp_path / "run"
    cfg = parse_args_to_config("tiny", [f"model.hf_path={hf}", "model.seq_length=96", f"train.run_dir={run}"])
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    shutil.copytree(hf, run / "tokenizer", ignore=shutil.ignore_patterns("config.json"))
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    from megatron_logra.checkpoint.integrity import FORMAT_VERSION

    (step / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": 2, "config": to_dict(cfg)}))
    (run / "checkpoints" / "latest").write_text(step.name)
    new = tmp_path / "elsewhere"
    hf.rename(new)
    return run, hf, new


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_moved_hf_path_is_named_with_the_override(moved, command):
    run, old, new = moved
    with pytest.raises(ValueError) as info:
        run_dir_config(run, [], command=command)
    err = str(info.value)
    assert f"model.hf_path={str(old)!r}, the Hugging Face checkpoint the run started from, is not there" in err, err
    assert "give its location with model.hf_path=DIR" in err and str(run / "config.yaml") in err, err
    cfg = run_dir_config(run, [f"model.hf_path={new}"], command=command)
    assert cfg.model.hf_path == str(new) and cfg.model.num_layers == 2
