"""A W&B run that cannot start (online without credentials) is the same error on every rank of a launch, on a
real gloo world of 2 processes: only rank 0 starts W&B, and before, the other ranks went on into the job's next
collective and waited there."""

from __future__ import annotations

import json
import os

import pytest

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, out: str, home: str) -> None:
    os.environ.update(WANDB_MODE="online", HOME=home, WANDB_SILENT="true")
    os.environ.pop("WANDB_API_KEY", None)
    from megatron_logra.metrics import MetricsWriter
    from megatron_logra.wandb_log import WandbOptions

    try:
        MetricsWriter(os.path.join(out, "run"), tensorboard=False, wandb=WandbOptions(project="p"))
        message = ""
    except ValueError as exc:
        message = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"message": message}, fh)


def test_a_wandb_run_that_cannot_start_stops_every_rank(tmp_path):
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    spawn_group(_worker, 2, tmp_path, str(tmp_path), str(home), timeout_s=60.0)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text())["message"] for r in range(2)]
    assert got[0] == got[1]
    assert got[0].startswith("train.wandb_project='p': W&B could not start its run") and "WANDB_MODE=offline" in got[0]
