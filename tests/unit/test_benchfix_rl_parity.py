"""``benchmarks/rl_parity.py``: only the documented run writes the committed results, ``--out`` writes
anywhere else, the files record the command as given (overrides and ``--run-root`` included), and an
output that cannot be written is refused before any training run starts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import ModuleType

import pytest

from support.scripts import load_script


@pytest.fixture(scope="module")
def rlp() -> ModuleType:
    return load_script("benchmarks/rl_parity.py", "rl_parity_bench")


def _args(rlp, argv):
    return rlp.build_parser().parse_args(argv)


@pytest.mark.parametrize("argv, stem", [
    ([], "COMMITTED"),
    (["--seeds", "1", "2", "3", "--steps", "120", "--run-root", "/tmp/elsewhere"], "COMMITTED"),
    (["--seeds", "1", "--steps", "2", "--run-root", "R"], "R/rl_parity"),
    (["--steps", "120", "rl.eval_interval=1"], "runs/bench-rl-parity/rl_parity"),
    (["--seeds", "1", "--out", "x/rl_parity.v2.md"], "x/rl_parity.v2"),
    (["--out", "x/y.json"], "x/y"),
])
def test_only_the_documented_run_writes_the_committed_results(rlp, argv, stem):
    """A smoke run (``--seeds 1 --steps 2``) used to replace the committed 3-seed, 120-update files."""
    want = rlp.RESULTS / "rl_parity" if stem == "COMMITTED" else Path(stem)
    assert rlp.output_stem(_args(rlp, argv)) == want


def _rows():
    rows = []
    for seed, (lo, de) in zip((1, 2), ((0.50, 0.40), (0.70, 0.60))):
        for recipe, after in (("tiny", lo), ("tiny-adam", de)):
            rows.append({"recipe": recipe, "seed": seed, "wall_seconds": 10.0 if recipe == "tiny" else 8.0,
                         "peak_rss_mib": 500.0, "eval_before": 0.1, "eval_after": after,
                         "kl_rel_error_median": 0.05 if recipe == "tiny" else None,
                         "eval_curve": {1: 0.1 * seed, 2: after}})
    return rows


def test_files_record_the_command_as_given(rlp):
    """The recorded line used to be rebuilt from --seeds and --steps only: overrides that change the
    numbers and --run-root were lost."""
    argv = ["--seeds", "1", "2", "--steps", "2", "--run-root", "/tmp/a b", "rl.eval_interval=1"]
    args = _args(rlp, argv)
    command = rlp.command_line(argv)
    assert shlex.split(command) == ["python", "benchmarks/rl_parity.py", *argv]
    text, md, data = rlp.render(_rows(), args, command)
    assert f"Command: `{command}`" in md and "rl.eval_interval=1" in md and "'/tmp/a b'" in md
    assert md.startswith("# RL parity (seeds [1, 2], 2 updates, overrides rl.eval_interval=1)")
    assert data["command"] == command and data["rows"] == _rows() and json.dumps(data)
    # the numbers: means over the two seeds, sd of (0.5, 0.7) = 0.1414
    assert data["table"]["LoGRA"]["after"] == pytest.approx(0.6)
    assert data["table"]["LoGRA"]["sd"] == pytest.approx(0.141421, rel=1e-5)
    assert "| LoGRA | 0.100 | 0.600 ± 0.141 | +50.0 | 10 | 1.25 | 500 | 1.00 | 5.0% |" in text
    assert "| dense AdamW | 0.150 ± 0.071 | 0.500 ± 0.141 |" in text  # the curve at updates 1 and 2


@pytest.mark.parametrize("case", ["parent is a file", "out.md is a directory"])
def test_unwritable_out_is_refused_before_any_run(rlp, tmp_path, capsys, case):
    blocker = tmp_path / "blocker"
    if case == "parent is a file":
        blocker.write_text("")
        out = blocker / "sub" / "res"
    else:
        (tmp_path / "res.md").mkdir()
        out = tmp_path / "res"
    with pytest.raises(SystemExit) as exc:
        rlp.main(["--seeds", "1", "--steps", "1", "--run-root", str(tmp_path / "runs"), "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --out:" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # no training run was started
