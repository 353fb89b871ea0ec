"""``megatron-logra bench paper --render-only``: the order of ``--figures`` names the same report (its file name
lists the figures in report order), so re-rendering a run of ``--figures cosine memory`` with ``--figures
memory cosine`` re-renders it rather than refusing it as the run of other flags; other settings still differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_logra.bench.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture
def out_dir(tmp_path) -> Path:
    """A results JSON of a quick run of the memory and cosine figures, given as ``--figures cosine memory``."""
    source = DOCS / "results" / "results-quick.json"
    if not source.exists():
        pytest.skip("docs/results/results-quick.json is not in this checkout")
    out = tmp_path / "docs"
    (out / "results").mkdir(parents=True)
    data = json.loads(source.read_text())
    data["config"].update(figures=["cosine", "memory"], out_dir=str(out))
    data["command"] = "megatron-logra bench paper --quick --figures cosine memory"
    (out / "results" / "results-quick-memory-cosine.json").write_text(json.dumps(data))
    for png in (DOCS / "results").glob("quick-fig*.png"):
        shutil.copyfile(png, out / "results" / png.name.replace("quick-", "quick-memory-cosine-", 1))
    return out


@pytest.mark.parametrize("order", [["cosine", "memory"], ["memory", "cosine"]])
def test_either_order_of_figures_re_renders_the_report(out_dir, order, capsys):
    assert main(["paper", "--render-only", "--quick", "--figures", *order, "--out-dir", str(out_dir)]) == 0
    text = (out_dir / "results-quick-memory-cosine.md").read_text()
    assert "Command: `megatron-logra bench paper --quick --figures cosine memory`" in text  # what ran
    assert text.startswith("# Paper figures at small scale (quick budget, memory, cosine only)\n")


def test_another_setting_is_still_refused(out_dir, capsys):
    try:
        code = main(["paper", "--render-only", "--quick", "--figures", "memory", "cosine", "--optimizers", "logra",
                     "adam", "--out-dir", str(out_dir)])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert "does not exist" in capsys.readouterr().err  # its own report name, which no run wrote
