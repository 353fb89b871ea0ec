"""``benchmarks/dynamic_sampling.py``: its table against statistics computed here from the rows, and only the
documented run writes the committed results."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from support.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/dynamic_sampling.py", "dynamic_sampling_bench")


def _row(seed, rounds, after, uniform, extra, wall):
    return {"seed": seed, "rounds": rounds, "wall_seconds": wall, "eval_before": 0.035, "eval_after": after,
            "uniform_per_update": uniform, "extra_rounds_per_update": extra, "skipped": 0, "updates": 60}


def test_the_table_holds_means_sds_and_ratios_to_the_run_without(bench):
    rows = [_row(1, 0, 0.74, 1.1, 0.0, 30.0), _row(1, 2, 0.80, 0.0, 0.5, 42.0),
            _row(2, 0, 0.70, 0.9, 0.0, 34.0), _row(2, 2, 0.78, 0.1, 0.4, 50.0)]
    text, table = bench.render(rows, 2)
    on_after = [0.80, 0.78]
    assert table["2"]["after"] == pytest.approx(statistics.mean(on_after))
    assert table["2"]["sd"] == pytest.approx(statistics.stdev(on_after))
    off_row, on_row = text.splitlines()[2:4]
    assert off_row.startswith("| off | 0.035 | 0.720 ± 0.028 | +68.5 | 1.00 | 0.00 | 1.00 | 32 | 1.00 |")
    wall_ratio = statistics.mean([42.0, 50.0]) / statistics.mean([30.0, 34.0])
    assert on_row.startswith("| 2 rounds | 0.035 | 0.790 ± 0.014 | +75.5 | 0.05 | 0.45 | 1.45 | 46 | ")
    assert on_row.endswith(f"| {wall_ratio:.2f} |")


@pytest.mark.parametrize("argv, stem", [
    ([], "COMMITTED"),
    (["--seeds", "1", "2", "3", "--steps", "60", "--rounds", "2", "--run-root", "/tmp/x"], "COMMITTED"),
    (["--seeds", "1", "--steps", "2"], "runs/bench-dynamic-sampling/dynamic_sampling"),
    (["--rounds", "3", "--run-root", "R"], "R/dynamic_sampling"),
    (["--out", "x/ds.md"], "x/ds"),
    (["--out", "x/ds.v2.json"], "x/ds.v2"),
])
def test_only_the_documented_run_writes_the_committed_results(bench, argv, stem):
    want = bench.RESULTS / "dynamic_sampling" if stem == "COMMITTED" else Path(stem)
    assert bench.output_stem(bench.build_parser().parse_args(argv)) == want


def test_an_out_that_cannot_be_written_is_refused_before_any_run(bench, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "file" / "ds"), "--run-root", str(tmp_path / "runs")])
    assert exc.value.code == 2 and "argument --out" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
