"""A run directory that cannot be written (a read-only mount of a finished run, a share without write access):
``train --resume`` of it is refused before anything is built, with one line naming ``train.run_dir`` and what to
do (it used to load the checkpoint and end in an ``OSError`` traceback writing ``config.yaml``); ``eval`` of it,
which only reads, works."""

from __future__ import annotations

import json

import pytest

from support.cli import exit_2, one_process_cli  # noqa: F401
from support.read_only import read_only
from support.run_fixtures import run_recipe


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ro") / "run"
    run_recipe("lm-tiny", [f"train.run_dir={run}", "train.steps=2", "train.save_interval=2", "train.progress=false"])
    return run


def _files(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resuming_a_read_only_run_directory_is_refused_naming_it(run, capsys):
    before = _files(run)
    with read_only(run):
        err = exit_2(["train", "--resume", str(run), "train.steps=4"], capsys)
    assert f"train.run_dir={str(run)!r} cannot be written" in err
    assert "make it writable, or copy the run elsewhere and resume the copy" in err
    assert "loaded checkpoint" not in err  # refused before the model was built
    assert _files(run) == before


def test_a_read_only_run_directory_is_evaluated(run, capsys):
    from megatron_logra.cli import main

    capsys.readouterr()
    with read_only(run):
        assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["step"] == 2
