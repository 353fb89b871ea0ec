"""``benchmarks/convert_memory.py --out``: checked before the benchmark runs (minutes at the default
sizes); a missing directory is created, a path that cannot be written is a usage error."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from support.scripts import load_script


@pytest.fixture(scope="module")
def cm() -> ModuleType:
    return load_script("benchmarks/convert_memory.py", "convert_memory_bench")


def test_missing_directory_is_created_up_front(cm, tmp_path):
    out = tmp_path / "a" / "b" / "x.md"
    cm.prepare_out(argparse.ArgumentParser(), out)
    assert out.parent.is_dir() and not out.exists()


@pytest.mark.parametrize("case", ["parent is a file", "out is a directory"])
def test_unwritable_out_is_refused_before_the_run(cm, tmp_path, capsys, case):
    """Used to run the whole benchmark and end with a FileNotFoundError / NotADirectoryError traceback."""
    blocker = tmp_path / "blocker"
    if case == "parent is a file":
        blocker.write_text("")
        out = blocker / "x.md"
    else:
        blocker.mkdir()
        out = blocker
    with pytest.raises(SystemExit) as exc:
        cm.main(["--sizes", "16x2", "--out", str(out)])
    err = capsys.readouterr()
    assert exc.value.code == 2, err.out[-500:]
    assert err.out == ""  # nothing ran: no table was printed
    assert "argument --out" in err.err and "Traceback" not in err.err
