"""``megatron-logra convert`` reports bad paths as the main CLI does: one line, exit status 2 (an output
path under a file was a NotADirectoryError traceback)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatron_logra.checkpoint import save_checkpoint
from megatron_logra.convert.cli import main
from megatron_logra.models.gpt import build_gpt
from test_checkpoint_checksums import MODEL


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def test_output_under_a_file_is_one_line_and_exit_2(groups, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(MODEL, groups, seed=1)
    step = save_checkpoint(tmp_path / "run", 1, model, None, groups, config={"model": dataclasses.asdict(MODEL)})
    (tmp_path / "afile").write_text("not a directory")
    assert main(["mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "afile" / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-logra convert mcore-to-hf: error:") and "Not a directory" in err
    assert "\n" not in err and "Traceback" not in err
