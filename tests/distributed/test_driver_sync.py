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
DRIVEN = [(2, 1, "float32"), (1, 2, "float32"), (2, 1, "bfloat16"), (1, 2, "bfloat16")]
OWNED = {"tp2": 2, "dp2": 1}


def _case(tp: int, pp: int, mode: str, dtype: str = "float32") -> str:
    return f"{tp},{pp},{mode},{dtype}"


@pytest.fixture(scope="module")
def cases(launcher, tmp_path_factory) -> Path:
    """Every case of this module in one launch of two ranks (each case on megatron groups built anew): a
    launch's start-up once instead of per case. ``OUT/CASE/rank{r}.json`` per case."""
    out = tmp_path_factory.mktemp("driver_sync")
    names = [_case(tp, pp, "driven", dtype) for tp, pp, dtype in DRIVEN] + [_case(tp, 1, "owned") for tp in OWNED.values()]
    launcher.launch(2, [str(WORKER), str(out), *names], timeout=600, log=out / "launch.log")
    return out


def _results(cases: Path, case: str) -> list[dict]:
    assert (cases / case).is_dir(), f"case {case} did not run: see {cases / 'launch.log'}"
    return sorted((json.loads(p.read_text()) for p in (cases / case).glob("rank*.json")), key=lambda r: r["rank"])


@pytest.mark.parametrize("tp,pp,dtype", DRIVEN)
def test_only_the_driving_rank_builds_payloads_and_its_engine_equals_the_trainer(cases, tp, pp, dtype):
    """bfloat16: every merge rounds stochastically; the drift check after each of the three deltas
    compares the engine (TP 1, HF layout) with the sharded trainer."""
    results = _results(cases, _case(tp, pp, "driven", dtype))
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


@pytest.mark.parametrize("tp", OWNED.values(), ids=OWNED.keys())
def test_engines_each_rank_owns_fall_back_together_when_one_rejects_or_drifts(cases, tp):
    """An embedded engine per rank: rank 1's engine drifts (update 3) and then rejects a delta
    (update 4); both ranks must refit together and record it. At TP 2 one rank's refit alone would
    leave the other's collectives waiting; at DP 2 (two replicas) rank 0's engine is fine, but the
    metrics rank 0 writes must still show the other replica's drift. Every engine ends equal to
    the trainer."""
    results = _results(cases, _case(tp, 1, "owned"))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["receives"] is True and r["version"] == 4 and r["differ"] == []
        assert [(rec["sync_mode"], rec["sync_drift"]) for rec in r["records"]] == \
            [("delta", 0), ("delta", 0), ("delta+anchor", 1), ("full", 1)], r
