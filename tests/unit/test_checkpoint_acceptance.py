"""Checkpoints as a cluster user meets them: a missing, empty or foreign ``checkpoints/latest``, a damaged
newest checkpoint, a checkpoint pruned while it is read, a failed save, and two jobs in one run directory.

Real saves of a tiny model (single-process gloo world) and real files; the second job is a real process.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest
from support import forked

from megatron_logra.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_meta, save_checkpoint
from megatron_logra.checkpoint import integrity
from megatron_logra.checkpoint.run_dir import claim_run_dir
from test_checkpoint_checksums import _model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def model(groups):
    return _model(groups, seed=5)


@pytest.fixture(scope="module")
def two_saves(model, groups, tmp_path_factory):
    """A run directory with complete checkpoints at steps 1 and 2 (``latest`` names step 2)."""
    run = tmp_path_factory.mktemp("acceptance") / "run"
    for step in (1, 2):
        save_checkpoint(run, step, model, None, groups, keep_last=5)
    return run


@pytest.fixture
def run(two_saves, tmp_path):
    """A fresh copy of :func:`two_saves` for a test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(two_saves, copy)
    return copy


def test_a_missing_latest_resumes_the_newest_complete_checkpoint(run, caplog):
    """A job killed between publishing its checkpoint (the rename) and writing ``latest`` (or ``latest``
    deleted): resuming must continue from the newest complete checkpoint, never start over from step 0
    (which went on to replace the complete checkpoints as it reached their steps)."""
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_00000003.tmp").mkdir()  # an unfinished save is no checkpoint
    with caplog.at_level(logging.WARNING, logger="megatron_logra.checkpoint.catalog"):
        found = latest_checkpoint(run)
    assert found is not None and found.name == "step_00000002"
    assert "latest is missing" in caplog.text and "step_00000002" in caplog.text


def test_no_checkpoint_at_all_is_still_none(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_00000001.tmp").mkdir(parents=True)
    assert latest_checkpoint(tmp_path / "run") is None


@pytest.mark.parametrize("content", ["other", "abs", "parent"])
def test_latest_naming_a_checkpoint_elsewhere_is_refused(run, two_saves, content):
    """``latest`` must name a checkpoint beside it: a path to another run's checkpoint was resumed from
    silently (weights and optimizer state of another run)."""
    elsewhere = two_saves / "checkpoints" / "step_00000001"
    text = {"other": "step_1", "abs": str(elsewhere),
            "parent": os.path.relpath(elsewhere, run / "checkpoints")}[content]
    (run / "checkpoints" / "latest").write_text(text + "\n")
    with pytest.raises(CheckpointError) as err:
        latest_checkpoint(run)
    message = str(err.value)
    assert "latest holds" in message and "not the name of a checkpoint directory" in message
    assert f"echo step_00000002 > {run / 'checkpoints' / 'latest'}" in message


def test_an_empty_latest_says_so_and_names_the_checkpoint_to_use(run):
    (run / "checkpoints" / "latest").write_text("")
    with pytest.raises(CheckpointError, match=r"latest holds nothing \(it is empty\).*newest checkpoint there is "
                                              r"step_00000002"):
        latest_checkpoint(run)


@pytest.mark.parametrize("damage", ["deleted", "no_meta"])
def test_latest_naming_a_missing_checkpoint_names_the_earlier_one(run, damage):
    step2 = run / "checkpoints" / "step_00000002"
    if damage == "deleted":
        shutil.rmtree(step2)
    else:
        (step2 / "meta.json").unlink()
    with pytest.raises(CheckpointError) as err:
        latest_checkpoint(run)
    message = str(err.value)
    assert "names step_00000002, which" in message
    assert ("does not exist" if damage == "deleted" else "has no meta.json") in message
    assert "newest earlier checkpoint there is step_00000001" in message
    assert f"echo step_00000001 > {run / 'checkpoints' / 'latest'}" in message


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
def test_a_damaged_newest_checkpoint_names_the_earlier_one(run, model, groups, damage):
    """The load refuses the damaged checkpoint (naming the file) and says how to continue from step 1;
    pointing ``latest`` there then loads."""
    shard = sorted((run / "checkpoints" / "step_00000002" / "dist").glob("*.distcp"))[0]
    if damage == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncated":
        os.truncate(shard, shard.stat().st_size - 7)
    else:
        shard.unlink()
    latest = run / "checkpoints" / "latest"
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(latest_checkpoint(run), model, None, groups)
    message = str(err.value)
    assert shard.name in message
    assert f"newest earlier checkpoint there is step_00000001: to continue from it, write its name into {latest}" \
        in message
    latest.write_text("step_00000001")
    assert load_checkpoint(latest_checkpoint(run), model, None, groups)["step"] == 1


def test_a_checkpoint_pruned_while_it_is_read_says_so(run, monkeypatch):
    """``eval`` or ``convert`` reading the checkpoint that the job still training deletes (pruning beyond
    ``train.keep_last``): the error says it was removed, not that a file is damaged. The deletion is real;
    it is made to happen right after the reader opened meta.json."""
    ckpt = latest_checkpoint(run)
    real = integrity._size_problems

    def pruned_meanwhile(path, recorded):
        shutil.rmtree(path)
        return real(path, recorded)

    monkeypatch.setattr(integrity, "_size_problems", pruned_meanwhile)
    with pytest.raises(CheckpointError, match=r"step_00000002 was removed while it was being read .*train.keep_last"):
        read_meta(ckpt)


def test_a_checkpoint_pruned_while_convert_reads_its_tensors_says_so(run):
    """``convert mcore-to-hf`` reads a trainer checkpoint's tensors after its checks passed; the job still
    training prunes it meanwhile (a real deletion between opening and reading): the error says it was removed
    (it was a raw FileNotFoundError from torch's reader)."""
    from megatron_logra.convert.dcp_reader import DistTensors

    ckpt = latest_checkpoint(run)
    reader = DistTensors(ckpt / "dist")
    key = next(k for k in reader.metadata.state_dict_metadata if k in reader)
    assert reader.read(key).numel() > 0
    shutil.rmtree(ckpt)
    with pytest.raises(ValueError, match=r"step_00000002 was removed while it was being read .*train.keep_last"):
        reader.read(key)


def test_a_failed_save_says_how_much_room_is_left_and_how_to_continue(model, groups, tmp_path):
    """torch's writer reports a full disk as e.g. ``unexpected pos 704 vs 598``: the error adds the free space
    and the way on. (The failure here is a ``checkpoints`` path that is a file.)"""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(run, 1, model, None, groups)
    message = str(err.value)
    assert "saving checkpoint step 1 failed" in message
    assert "MiB free" in message and f"continue with --resume {run}" in message
    assert (run / "checkpoints").read_text() == "not a directory"


_HOLDER = """
import pathlib, sys, time
pathlib.Path(sys.argv[1]).mkdir(parents=True)
from megatron_logra.checkpoint.run_dir import lock_run_dir
assert lock_run_dir(sys.argv[1]) is None
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_job_in_a_running_jobs_run_directory_is_refused(tmp_path):
    """Two jobs in one run directory (a resubmitted job while the first still runs) removed each other's
    unfinished saves and pruned each other's checkpoints. The second is refused, resumed or not, naming the
    first; once the first is gone (even SIGKILLed) the directory can be resumed."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        for resume in (True, False):
            with pytest.raises(ValueError) as err:
                claim_run_dir(run, resume=resume, overwrite=not resume)
            message = str(err.value)
            assert "in use by another running job" in message and "another train.run_dir" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    claim_run_dir(run, resume=True, overwrite=False)  # the kernel released the dead job's lock
    claim_run_dir(run, resume=True, overwrite=False)  # this process holds it already: taking it again is fine


_TRY_LOCK = """
import sys
from megatron_logra.checkpoint.run_dir import lock_run_dir
sys.exit(0 if lock_run_dir(sys.argv[1]) is None else 3)
"""


def _other_process_can_lock(run) -> bool:
    # another process (forked warm where it can be: a child of the fork server, holding none of this process's files)
    proc = forked.python(["-c", _TRY_LOCK, str(run)], timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    return proc.returncode == 0


def test_a_job_releases_its_run_directory_when_it_ends(tmp_path):
    """The lock is the job's, not the process's: a job that returns or fails releases it, so a later job of
    the same script, or another process, can take the directory (eval or resume right after a run)."""
    from types import SimpleNamespace

    from megatron_logra.checkpoint.run_dir import lock_run_dir, releasing_run_dir

    run = tmp_path / "run"
    run.mkdir()

    @releasing_run_dir
    def job(cfg):
        assert lock_run_dir(cfg.train.run_dir) is None
        assert not _other_process_can_lock(run)  # held while the job runs
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError, match="the job failed"):
        job(SimpleNamespace(train=SimpleNamespace(run_dir=str(run))))
    assert _other_process_can_lock(run)
