"""``benchmarks/optimizer_memory.py``: output names keep every dot of their stem, ``--render`` writes only
the markdown beside the JSON it reads, ``--sizes`` refuses a hidden size its heads cannot divide before
any child starts, and a failing child ends the run with one line (its log kept in a file)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def om() -> ModuleType:
    spec = importlib.util.spec_from_file_location("optimizer_memory_bench", ROOT / "benchmarks" / "optimizer_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module through it
    spec.loader.exec_module(module)
    return module


def test_render_of_a_dotted_name_writes_its_own_markdown_only(om, tmp_path, capsys):
    """Re-rendering ``optimizer_memory.2026-12-02.json`` used to write ``optimizer_memory.md`` and
    ``optimizer_memory.json`` (``with_suffix`` drops the last dot part), overwriting other results."""
    src = tmp_path / "optimizer_memory.2026-12-02.json"
    shutil.copy(ROOT / "benchmarks" / "results" / "optimizer_memory_quick.json", src)
    before = src.read_bytes()
    om.main(["--render", str(src)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer_memory.2026-12-02.json",
                                                          "optimizer_memory.2026-12-02.md"]
    assert src.read_bytes() == before  # the input is not rewritten
    md = (tmp_path / "optimizer_memory.2026-12-02.md").read_text()
    rows = json.loads(before)["rows"]
    assert md.count("\n") > 10 and all(f"{r['hidden']}" in md for r in rows)
    assert f"wrote {tmp_path / 'optimizer_memory.2026-12-02.md'}" in capsys.readouterr().out


@pytest.mark.parametrize("given, stem", [
    ("results/optimizer_memory.v2", "results/optimizer_memory.v2"),
    ("results/optimizer_memory.v2.md", "results/optimizer_memory.v2"),
    ("results/run.2026.12.json", "results/run.2026.12"),
    ("plain", "plain"),
    (".md", ".md"),
])
def test_output_stem_keeps_every_dot(om, given, stem):
    out = om.output_stem(given)
    assert out == Path(stem)
    assert om.with_ext(out, ".md") == Path(stem + ".md") and om.with_ext(out, ".json") == Path(stem + ".json")


@pytest.mark.parametrize("sizes", ["200x1", "64x1,200x2", "300", "99"])
def test_sizes_the_heads_cannot_divide_are_refused_up_front(om, sizes, capsys):
    """``--sizes 200x1`` (3 heads of a 200-wide model) used to start three children and end ~30 s later
    with nested tracebacks (300: 4 heads of odd dimension 75, a rotary shape error); now it is an argparse
    error naming ``--sizes`` and the head count."""
    with pytest.raises(SystemExit) as exc:
        om.main(["--sizes", sizes])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--sizes" in err and "attention heads" in err and "Traceback" not in err
    assert om.parse_sizes("64x1,128x2,192,1024x1") == [(64, 1), (128, 2), (192, 1), (1024, 1)]
    assert om.parse_sizes("100,576") == [(100, 1), (576, 1)]  # one head of 100; 9 heads of 64


def test_a_failing_child_is_one_line_with_its_log_kept(om, tmp_path):
    """A real child process that prints a traceback and reports an error, as ``child_main`` does."""
    script = ("import json, sys\n"
              "print('Traceback (most recent call last):\\nValueError: model.hidden_size=200', file=sys.stderr)\n"
              "print(json.dumps({'ok': False, 'error': 'ValueError: model.hidden_size=200'}), flush=True)\n")
    log = (tmp_path / "log").open("w+")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    child = om.ChildProc("adam", proc, log)
    try:
        with pytest.raises(om.ChildFailed) as exc:
            child.recv()
    finally:
        proc.wait(timeout=30)
    assert str(exc.value) == "child adam failed: ValueError: model.hidden_size=200"
    saved = exc.value.save_log()
    try:
        assert "Traceback (most recent call last)" in saved.read_text()
    finally:
        saved.unlink()


def test_the_report_names_the_machine_it_was_measured_on_not_the_one_rendering_it(monkeypatch):
    """A stored run re-rendered elsewhere keeps its own CPU count and model; runs stored before the machine was
    recorded say so instead of borrowing the renderer's."""
    import json

    from megatron_logra.bench import optimizer_memory_report as report

    saved = json.loads((ROOT / "benchmarks" / "results" / "optimizer_memory.json").read_text())
    monkeypatch.setattr("os.cpu_count", lambda: 96)
    meta = {**saved["meta"], "cpus": 2, "cpu": "Some CPU"}
    text = report.markdown(saved["rows"], meta)
    assert "on 2 CPUs (Some CPU)." in text and "96" not in text.split("\n\n")[1]
    old = {k: v for k, v in saved["meta"].items() if k not in ("cpus", "cpu")}
    assert "(machine not recorded)." in report.markdown(saved["rows"], old)
