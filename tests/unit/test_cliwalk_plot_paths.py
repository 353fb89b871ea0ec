"""``megatron-logra plot``'s paths: ``--out`` naming a folder (one that exists, or written with a trailing
slash) puts ``summary.png`` in it rather than a sibling ``FOLDER.png``; a run's ``metrics.jsonl`` given as
the run is named as a file, with the folder to give."""

from __future__ import annotations

import json

import pytest

from megatron_logra.cli import main


def _run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "reward_mean": 0.25 * s, "accuracy": 0.125 * s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_out_naming_an_existing_folder_writes_summary_png_in_it(tmp_path, capsys):
    run, folder = _run(tmp_path), tmp_path / "figures"
    folder.mkdir()
    assert main(["plot", str(run), "--out", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == str(folder / "summary.png")
    assert (folder / "summary.png").stat().st_size > 0
    assert not (tmp_path / "figures.png").exists()


def test_out_with_a_trailing_slash_is_a_folder_to_create(tmp_path, capsys):
    run, folder = _run(tmp_path), tmp_path / "new" / "figs"
    assert main(["plot", str(run), "--out", f"{folder}/"]) == 0
    assert capsys.readouterr().out.strip() == str(folder / "summary.png")
    assert (folder / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (folder.parent / "figs.png").exists()


def test_out_naming_a_file_is_unchanged(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["plot", str(run), "--out", str(tmp_path / "a" / "fig")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a" / "fig.png")


def test_the_metrics_file_given_as_the_run_names_the_folder(tmp_path, capsys):
    run = _run(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(run / "metrics.jsonl")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is a file, not a run directory" in err and f"({run})" in err
    assert "metrics.jsonl/metrics.jsonl" not in err
