"""``megatron-logra plot`` of a killed run: a torn last line of ``metrics.jsonl`` (cut mid-write, no newline)
is dropped as ``--resume`` drops it; a corrupt line anywhere else is still an error naming file and line."""

from __future__ import annotations

import json
import logging

import pytest

from megatron_logra.cli import main
from megatron_logra.plot import read_metrics


def _run(tmp_path, text: str):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(text)
    return run


GOOD = "".join(json.dumps({"step": s, "loss": 3.0 - s}) + "\n" for s in (1, 2))


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog, capsys):
    run = _run(tmp_path, GOOD + '{"step": 3, "loss": 0.1')
    with caplog.at_level(logging.WARNING, logger="megatron_logra.plot"):
        assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert "metrics.jsonl:3: dropping a torn last record" in caplog.text
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "summary.png")
    assert (run / "summary.png").stat().st_size > 0


@pytest.mark.parametrize("text, lineno", [
    (GOOD.replace("\n", '\n{"step": 9, "lo\n', 1), 2),  # torn, but not the last line
    (GOOD + '{"step": 3, "loss": 0.1\n', 3),  # last line, but complete (a newline follows): not a torn write
])
def test_a_corrupt_line_that_is_not_a_torn_end_names_file_and_line(tmp_path, text, lineno):
    run = _run(tmp_path, text)
    with pytest.raises(ValueError, match=rf"metrics\.jsonl:{lineno} is not JSON"):
        read_metrics(run)


def test_a_file_holding_only_a_torn_line_has_no_records(tmp_path):
    with pytest.raises(ValueError, match="has no records"):
        read_metrics(_run(tmp_path, '{"step": 1, "lo'))
