"""``benchmarks/dynamic_batch.py``: its table's ratios against ones computed here from the rows, only the
documented run writes the committed results, and an unwritable ``--out`` is refused before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/dynamic_batch.py", "dynamic_batch_bench")


def test_the_table_holds_ratios_to_the_fixed_layout(bench):
    rows = [{"layout": "fixed", "micro_batches": 8, "positions": 32768, "seconds": 4.0, "sketch_rel_diff": 0.0},
            {"layout": "dynamic", "micro_batches": 5, "positions": 8192, "seconds": 1.3, "sketch_rel_diff": 2e-6}]
    lines = bench.render(rows, "head").splitlines()
    assert lines[0] == "head"
    assert lines[4] == "| fixed | 8 | 32768 | 1.00 | 4.00 | 1.00 | 0.0e+00 |"
    assert lines[5] == f"| dynamic | 5 | 8192 | {8192 / 32768:.2f} | 1.30 | {1.3 / 4.0:.2f} | 2.0e-06 |"


@pytest.mark.parametrize("argv, stem", [
    ([], "COMMITTED"),
    (["--repeats", "3", "--seq", "512"], "COMMITTED"),
    (["--repeats", "1"], "runs/bench-dynamic-batch/dynamic_batch"),
    (["--out", "x/db.md"], "x/db"),
    (["--out", "x/db.v2.json"], "x/db.v2"),
])
def test_only_the_documented_run_writes_the_committed_results(bench, argv, stem):
    want = bench.RESULTS / "dynamic_batch" if stem == "COMMITTED" else Path(stem)
    assert bench.output_stem(bench.build_parser().parse_args(argv)) == want


def test_an_out_that_cannot_be_written_is_refused_before_anything_is_built(bench, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "file" / "db")])
    assert exc.value.code == 2 and "argument --out" in capsys.readouterr().err
