"""The run directory must be one shared directory for every rank (2 gloo processes on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.checkpoint.run_dir import check_shared_storage
from support.gloo import spawn_group

pytestmark = pytest.mark.distributed


def _shared_worker(rank: int, world: int, dirs: list[str], out: str) -> None:
    try:
        check_shared_storage(Path(dirs[rank]), wait_s=0.5)
        result = "ok"
    except ValueError as exc:
        result = str(exc)
    Path(f"{out}.{rank}").write_text(result)


def test_a_run_dir_that_is_not_shared_between_ranks_is_refused_on_every_rank(tmp_path):
    """Rank 1 looks at another directory under the same name, as a node-local disk would show it."""

    def run(dirs, name):
        out = str(tmp_path / name)
        spawn_group(_shared_worker, 2, tmp_path, dirs, out)
        return [Path(f"{out}.{r}").read_text() for r in range(2)]

    shared = str(tmp_path / "run")
    assert run([shared, shared], "same") == ["ok", "ok"]
    assert not list((tmp_path / "run").iterdir())  # the probe file is removed
    results = run([str(tmp_path / "node0" / "run"), str(tmp_path / "node1" / "run")], "local")
    for message in results:  # each rank names the path as it sees it, and the same blind rank
        assert "is not shared storage: rank 1 on " in message and "rank 0 on" not in message


def test_a_run_dir_rank_0_cannot_write_is_refused_on_every_rank_without_waiting(tmp_path):
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "unwritable")
    bad = str(tmp_path / "afile" / "run")
    spawn_group(_shared_worker, 2, tmp_path, [bad, bad], out, timeout_s=60.0)
    for r in range(2):
        message = Path(f"{out}.{r}").read_text()
        assert "cannot be written" in message and "train.run_dir=" in message, (r, message)


def _one_rank_cannot_write_worker(rank: int, world: int, path: str, out: str) -> None:
    from megatron_logra.checkpoint import run_dir_storage as run_dir_mod

    if rank == 1:  # a read-only mount on this rank's node (root writes anywhere here, so the failure is injected)
        run_dir_mod._unwritable = lambda d: f"train.run_dir={str(d)!r} cannot be written: Read-only file system"
    _shared_worker(rank, world, [path, path], out)


def test_a_run_dir_one_rank_cannot_write_is_refused_on_every_rank(tmp_path):
    out = str(tmp_path / "readonly")
    spawn_group(_one_rank_cannot_write_worker, 2, tmp_path, str(tmp_path / "run"), out, timeout_s=60.0)
    for r in range(2):
        message = Path(f"{out}.{r}").read_text()
        assert "Read-only file system" in message and "seen by rank 1 on " in message, (r, message)
