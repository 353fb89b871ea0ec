"""A directory this project wrote, given where a Hugging Face checkpoint is expected (``--model.hf_path``,
``convert hf-to-mcore --hf``), is refused naming what it is and what to give instead.

The common case: ``convert hf-to-mcore --tp 4`` (as a Megatron-LM user prepares a checkpoint), then
``train --model.hf_path`` of its output. The error names the Hugging Face directory the conversion came from
(recorded in its ``meta.json``); for a run directory or a trainer checkpoint it names ``convert mcore-to-hf``.
"""

from __future__ import annotations

import pytest

from megatron_logra.convert import convert_hf_to_mcore
from megatron_logra.convert.cli import main as convert_main
from support.cli import exit_2, one_process_cli  # noqa: F401 - autouse fixture
from support.convert_fixtures import tiny_llama_checkpoint
from support.run_fixtures import fake_run_dir


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``(hf, out)``: a tiny Llama checkpoint and its ``convert hf-to-mcore --tp 2`` output."""
    root = tmp_path_factory.mktemp("not_hf")
    hf = tiny_llama_checkpoint(root)
    out = root / "mcore_tp2"
    convert_hf_to_mcore(hf, out, tp=2)
    return hf, out


def test_train_from_a_converted_directory_names_its_source(converted, tmp_path, capsys):
    hf, out = converted
    err = exit_2(["config", "tiny", f"--model.hf_path={out}"], capsys)
    assert "megatron-core conversion written by `megatron-logra convert hf-to-mcore`" in err
    assert f"give the Hugging Face directory it was converted from ({hf.resolve()};" in err


def test_convert_of_a_converted_directory_names_its_source(converted, tmp_path, capsys):
    hf, out = converted
    assert convert_main(["hf-to-mcore", "--hf", str(out), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert f"converted from ({hf.resolve()};" in err and "Traceback" not in err
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("which", ["run", "checkpoint"])
def test_a_run_directory_or_checkpoint_names_the_export(which, tmp_path, capsys):
    run = tmp_path / "run"
    fake_run_dir(run)
    given = run if which == "run" else run / "checkpoints" / "step_00000002"
    err = exit_2(["config", "tiny", f"--model.hf_path={given}"], capsys)
    assert f"export it first with `megatron-logra convert mcore-to-hf --mcore {given} --out HF_DIR`" in err


def test_any_other_directory_without_config_json_is_refused_as_before(tmp_path, capsys):
    err = exit_2(["config", "tiny", f"--model.hf_path={tmp_path}"], capsys)
    assert err.rstrip().endswith("no config.json (expected a Hugging Face checkpoint directory)")
