"""Every rank stops after the same step: a signal that reaches one rank, or one rank's spent wall-time
budget, stops all of them (``train.stopping.EarlyStop.check`` is agreed over the world group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "early_stop_worker.py"


def test_one_ranks_reason_stops_every_rank(launcher, tmp_path):
    launcher.launch(2, [str(WORKER), str(tmp_path)], timeout=120, log=tmp_path / "launch.log")
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["checks"] == [None, "SIGTERM", "exit_duration_minutes=5"], r
