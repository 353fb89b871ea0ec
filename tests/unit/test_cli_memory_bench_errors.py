"""``megatron-logra memory --tp auto`` without ``--gpus`` says the GPU count its layout implies and what it assumed; ``megatron-logra
bench paper --render-only`` with a missing or malformed results file ends with a one-line
``megatron-logra bench paper: error: ...`` naming the file, exit status 2, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_logra import cli as top_cli
from megatron_logra.bench.cli import main as bench_main
from megatron_logra.bench.results_file import ResultsFileError, load_results
from megatron_logra.memory.cli import DEFAULT_AUTO_TP_GPUS
from megatron_logra.memory.cli import main as memory_main

ROOT = Path(__file__).resolve().parents[2]
QUICK_JSON = ROOT / "docs" / "results" / "results-quick.json"
MODEL = ["--model", "qwen2.5-1.5b"]


# --- memory: the GPUs that --tp auto assumes -------------------------------------------------------


@pytest.mark.parametrize("style", [["--markdown"], []])
def test_tp_auto_without_gpus_states_the_assumed_gpus(capsys, style):
    """It used to plan for 8 GPUs silently."""
    assert DEFAULT_AUTO_TP_GPUS == 8
    assert memory_main(MODEL + ["--tp", "auto"] + style) == 0
    out = capsys.readouterr().out
    first = out.lstrip().splitlines()[0]
    assert first.startswith("GPUs: 2 = TP 2 x PP 1 x DP 1 (no --gpus: 8-GPU nodes assumed"), first
    assert "TP <= 8 / PP = 8" in first and "DP 1 (default; set --dp)" in first
    assert "TP2 PP1 DP1" in out  # the layout planned: 1.5B shards at most 2 ways (2 KV heads)


def test_tp_auto_note_follows_pp_and_dp(capsys):
    assert memory_main(MODEL + ["--tp", "auto", "--pp", "2", "--dp", "3", "--markdown"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("GPUs: 12 = TP 2 x PP 2 x DP 3 (no --gpus: 8-GPU nodes assumed"), first
    assert "TP <= 8 / PP = 4" in first and "DP 3 from --dp" in first


@pytest.mark.parametrize("argv", [["--tp", "auto", "--gpus", "8"], ["--tp", "2"], []])
def test_no_note_when_nothing_is_assumed(capsys, argv):
    assert memory_main(MODEL + argv + ["--markdown"]) == 0
    assert "GPUs:" not in capsys.readouterr().out


def test_help_documents_the_default(capsys):
    with pytest.raises(SystemExit) as info:
        memory_main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Without ``--gpus``, ``--tp auto`` keeps each TP x PP group within one 8-GPU node" in text
    assert "Not given: --tp auto keeps TP x PP within one 8-GPU node" in text


# --- bench paper --render-only: bad results files --------------------------------------------------


def _render_error(capsys, out_dir: Path, *extra: str) -> str:
    """Run ``bench paper --render-only --quick`` on ``out_dir``; assert exit status 2 and return stderr."""
    assert bench_main(["paper", "--render-only", "--quick", "--out-dir", str(out_dir), *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("megatron-logra bench paper: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def _write(out_dir: Path, text: str) -> Path:
    (out_dir / "results").mkdir(parents=True, exist_ok=True)
    path = out_dir / "results" / "results-quick.json"
    path.write_text(text)
    return path


def test_missing_results_file(capsys, tmp_path):
    """It used to exit with status 1 and a bare message (``SystemExit(str)``)."""
    err = _render_error(capsys, tmp_path)
    source = tmp_path / "results" / "results-quick.json"
    assert f"{source} does not exist" in err
    assert f"run `megatron-logra bench paper --quick --out-dir {tmp_path}` first" in err
    assert not (tmp_path / "results-quick.md").exists()


@pytest.mark.parametrize("text, problem", [
    ("{not json", "is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
    ("", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not the object of a results file"),
    ('{"config": {}}', "is not a results file of `megatron-logra bench paper`: missing key 'runs'"),
    ('{"config": {"quick": true, "bogus": 1}, "runs": {}}', "unexpected keyword argument 'bogus'"),
    ('{"config": [1]}', "is not a results file of `megatron-logra bench paper`"),
])
def test_malformed_results_file(capsys, tmp_path, text, problem):
    """Each used to end in a traceback (JSONDecodeError, KeyError, TypeError) with exit status 1."""
    source = _write(tmp_path, text)
    err = _render_error(capsys, tmp_path)
    assert str(source) in err and problem in err
    assert not (tmp_path / "results-quick.md").exists()


def test_results_file_that_is_not_text(capsys, tmp_path):
    source = _write(tmp_path, "")
    source.write_bytes(b"\xff\xfe\x00")
    err = _render_error(capsys, tmp_path)
    assert f"{source} cannot be read as a results file" in err


def test_results_path_that_is_a_directory(capsys, tmp_path):
    source = tmp_path / "results" / "results-quick.json"
    source.mkdir(parents=True)
    err = _render_error(capsys, tmp_path)
    assert f"{source} cannot be read as a results file" in err


def test_results_with_values_of_the_wrong_type(capsys, tmp_path):
    """A report's JSON whose numbers are strings fails while rendering; nothing is written."""
    if not QUICK_JSON.exists():
        pytest.skip("docs/results/results-quick.json is not in this checkout")
    data = json.loads(QUICK_JSON.read_text())
    data["timings"] = {"total": "sixty"}
    source = _write(tmp_path, json.dumps(data))
    before = source.read_bytes()
    err = _render_error(capsys, tmp_path)
    assert f"{source} is not a results file of `megatron-logra bench paper` (rendering it failed)" in err
    assert source.read_bytes() == before and not (tmp_path / "results-quick.md").exists()


def test_traceback_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_LOGRA_TRACEBACK", "1")
    _write(tmp_path, "{not json")
    with pytest.raises(ResultsFileError, match="is not valid JSON"):
        bench_main(["paper", "--render-only", "--quick", "--out-dir", str(tmp_path)])


def test_load_results_raises_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"config": {}}')
    with pytest.raises(ValueError, match=r"r\.json is not a results file .*missing key 'runs'"):
        load_results(path)
    with pytest.raises(ValueError, match=r"nope\.json does not exist"):
        load_results(tmp_path / "nope.json")


def test_top_level_command_exits_2(capsys, tmp_path):
    """Through ``megatron-logra bench ...`` (the console script exits with what ``main`` returns)."""
    assert top_cli.main(["bench", "paper", "--render-only", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"megatron-logra bench paper: error: {tmp_path / 'results' / 'results.json'} does not exist" in err


def test_a_good_results_file_still_renders(tmp_path):
    if not QUICK_JSON.exists():
        pytest.skip("docs/results/results-quick.json is not in this checkout")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    out = tmp_path / "docs"
    assert bench_main(["paper", "--render-only", "--quick", "--out-dir", str(out)]) == 0
    assert (out / "results-quick.md").read_bytes() == (ROOT / "docs" / "results-quick.md").read_bytes()
