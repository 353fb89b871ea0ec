"""``megatron-logra plot``: a metrics line that is not a JSON object names the file and line; the printed path
is the file actually written."""

from __future__ import annotations

import json

import pytest

from megatron_logra.plot import plot_run, read_metrics


def _run(tmp_path, lines):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize("bad", ["[1, 2]", "5", '"text"', "null"])
def test_a_metrics_line_that_is_not_an_object_names_file_and_line(tmp_path, bad):
    run = _run(tmp_path, [json.dumps({"step": 1, "loss": 2.0}), bad])
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 .*not a JSON object"):
        read_metrics(run)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        plot_run(run)


def test_a_record_without_a_step_names_file_and_line(tmp_path):
    run = _run(tmp_path, [json.dumps({"loss": 2.0})])
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1 .*step"):
        plot_run(run)


@pytest.mark.parametrize("out_name, written", [
    ("afile", "afile.png"), ("fig.png", "fig.png"), ("fig.pdf", "fig.pdf"), ("a.b", "a.b.png"),
])
def test_plot_returns_the_path_it_wrote(tmp_path, out_name, written):
    run = _run(tmp_path, [json.dumps({"step": s, "loss": 3.0 - s}) for s in (1, 2)])
    got = plot_run(run, tmp_path / "x" / out_name)
    assert got == tmp_path / "x" / written and got.exists() and got.stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [written]


def test_plot_default_path(tmp_path):
    run = _run(tmp_path, [json.dumps({"step": 1, "loss": 1.0})])
    assert plot_run(run) == run / "summary.png" and (run / "summary.png").exists()
