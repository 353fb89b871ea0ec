"""Sketch-delta sync to an engine that one rank drives (SGLang's arrangement), on gloo.

With TP 2 and with PP 2 the driving rank's engine must end bitwise equal to the trainer after
three updates that each travelled as a delta alone (drift check after every update), while the
other rank built no payload (``sync_bytes`` 0) yet took part in every collective (no hang, same
versions and outcomes on both ranks); a delta the driver's engine rejects sends every rank into
the same full refit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "driver_sync_worker.py"


@pytest.mark.parametrize("tp,pp,dtype", [(2, 1, "float32"), (1, 2, "float32"), (2, 1, "bfloat16"), (1, 2, "bfloat16")])
def test_only_the_driving_rank_builds_payloads_and_its_engine_equals_the_trainer(launcher, tmp_path, tp, pp, dtype):
    """bfloat16: every merge rounds stochastically; the drift check after each of the three deltas
    compares the engine (TP 1, HF layout) with the sharded trainer."""
    launcher.launch(tp * pp, [str(WORKER), str(tmp_path), str(tp), str(pp), "driven", dtype], timeout=300,
                    log=tmp_path / "launch.log")
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(tp * pp))
    driver, other = results
    assert driver["receives"] is True and other["receives"] is False
    assert driver["target_version"] == 4
    for r in results:
        assert r["version"] == 4
        # three deltas, then the rejected one: every rank fell back to the same full refit
        assert [(rec["sync_mode"], rec["sync_drift"]) for rec in r["records"]] == [("delta", 0)] * 3 + [("full", 1)], r
    assert all(rec["sync_bytes"] > 0 for rec in driver["records"][:3])
    assert all(rec["sync_bytes"] == 0 for rec in other["records"][:3])
    assert driver["num_tensors"] == other["num_tensors"] > 0
    assert driver["differ"] == []


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_engines_each_rank_owns_fall_back_together_when_one_rejects_or_drifts(launcher, tmp_path, tp):
    """An embedded engine per rank: rank 1's engine drifts (update 3) and then rejects a delta
    (update 4); both ranks must refit together and record it. At TP 2 one rank's refit alone would
    leave the other's collectives waiting; at DP 2 (two replicas) rank 0's engine is fine, but the
    metrics rank 0 writes must still show the other replica's drift. Every engine ends equal to
    the trainer."""
    launcher.launch(2, [str(WORKER), str(tmp_path), str(tp), "1", "owned"], timeout=300, log=tmp_path / "launch.log")
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["receives"] is True and r["version"] == 4 and r["differ"] == []
        assert [(rec["sync_mode"], rec["sync_drift"]) for rec in r["records"]] == \
            [("delta", 0), ("delta", 0), ("delta+anchor", 1), ("full", 1)], r

