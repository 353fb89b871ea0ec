"""A resumed run's metrics: metrics.jsonl and TensorBoard both drop the points after the checkpoint."""

from __future__ import annotations

import json
import time

import pytest

from megatron_logra.metrics import MetricsWriter


def test_a_resume_drops_the_stale_points_from_jsonl_and_tensorboard(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("torch.utils.tensorboard")
    w = MetricsWriter(tmp_path)
    for s in range(1, 6):  # the first run got to step 5, its last checkpoint is step 3
        w.write({"step": s, "loss": 10.0 + s})
    w.close()
    # a resume is a later process; event files of one process in one second are ordered by a per-process
    # counter whose decimal string sorts wrong past 9 (".9" > ".10"), so start the second file a second later
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)
    w = MetricsWriter(tmp_path, truncate_after=3)
    for s in range(4, 7):
        w.write({"step": s, "loss": float(s)})
    w.close()
    want = [(1, 11.0), (2, 12.0), (3, 13.0), (4, 4.0), (5, 5.0), (6, 6.0)]  # an uninterrupted run's record
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == want
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == want
