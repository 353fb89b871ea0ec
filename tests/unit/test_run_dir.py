"""A new run never replaces an earlier one by accident, and bad run/checkpoint input is an error
message (exit status 2), not a traceback or lost files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_logra.checkpoint.run_dir import claim_run_dir


def _previous_run(root: Path) -> dict[str, bytes]:
    """A run directory as a finished run leaves it, plus a file of the user's; returns every file's bytes."""
    (root / "checkpoints" / "step_00000002").mkdir(parents=True)
    (root / "checkpoints" / "step_00000002" / "meta.json").write_text('{"format_version": 2}')
    (root / "checkpoints" / "latest").write_text("step_00000002")
    (root / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (root / "summary.json").write_text("{}")
    (root / "samples.jsonl").write_text('{"step": 1, "split": "train"}\n')  # rl.log_samples
    (root / "notes.txt").write_text("mine")
    return _files(root)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_new_run_in_a_used_directory_is_refused_and_nothing_is_touched(tmp_path):
    before = _previous_run(tmp_path)
    with pytest.raises(ValueError) as err:
        claim_run_dir(tmp_path, resume=False, overwrite=False)
    msg = str(err.value)
    assert "checkpoints/step_00000002" in msg and "metrics.jsonl" in msg
    assert f"--resume {tmp_path}" in msg and "train.overwrite=true" in msg
    assert _files(tmp_path) == before
    claim_run_dir(tmp_path, resume=True, overwrite=False)  # continuing it is fine
    assert _files(tmp_path) == before


def test_overwrite_removes_the_previous_run_only(tmp_path):
    _previous_run(tmp_path)
    claim_run_dir(tmp_path, resume=False, overwrite=True)
    assert _files(tmp_path) == {"notes.txt": b"mine"}


def test_fresh_empty_and_non_directory_run_dirs(tmp_path):
    claim_run_dir(tmp_path / "new", resume=False, overwrite=False)
    (tmp_path / "empty").mkdir()
    claim_run_dir(tmp_path / "empty", resume=False, overwrite=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        claim_run_dir(tmp_path / "afile", resume=False, overwrite=True)


def test_a_run_dir_that_cannot_be_written_is_refused_naming_the_field(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="cannot be written") as err:
        claim_run_dir(tmp_path / "afile" / "run", resume=False, overwrite=False)
    assert "train.run_dir=" in str(err.value) and "afile" in str(err.value)
    assert (tmp_path / "afile").read_text() == "x"
    claim_run_dir(tmp_path / "new" / "run", resume=False, overwrite=False)  # created, and left empty
    assert list((tmp_path / "new" / "run").iterdir()) == []


def test_cli_refuses_an_unwritable_run_dir_before_building_the_model(tmp_path, capsys, monkeypatch):
    import megatron_logra.rl.components as components
    from megatron_logra.cli import main

    def no_build(*args, **kw):
        raise AssertionError("the model was built for a run that cannot be saved")

    monkeypatch.setattr(components, "build_gpt", no_build)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["train", "tiny", f"train.run_dir={tmp_path / 'afile' / 'run'}", "rl.steps=1", "train.progress=false"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "train.run_dir" in err and "Traceback" not in err


def test_cli_refuses_a_used_run_dir_with_a_message(tmp_path, capsys):
    from megatron_logra.cli import main

    before = _previous_run(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["train", "tiny", f"train.run_dir={tmp_path}", "rl.steps=1", "train.progress=false"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "Traceback" not in err
    assert _files(tmp_path) == before


def test_cli_resume_with_another_run_dir_is_refused(tmp_path, capsys):
    from megatron_logra.cli import main
    from megatron_logra.config import to_dict, parse_args_to_config

    run = tmp_path / "run"
    run.mkdir()
    before = _previous_run(run)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(parse_args_to_config("tiny", [f"train.run_dir={run}"]))))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", str(run), f"train.run_dir={tmp_path / 'elsewhere'}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--resume {run}" in err and "elsewhere" in err
    assert not (tmp_path / "elsewhere").exists()
    assert {k: v for k, v in _files(run).items() if k != "config.yaml"} == before


def test_a_corrupt_checkpoint_is_an_error_message_not_a_traceback(tmp_path, capsys):
    from megatron_logra.cli import main
    from megatron_logra.config import to_dict, parse_args_to_config

    run = tmp_path / "run"
    run.mkdir()
    _previous_run(run)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(parse_args_to_config("tiny", [f"train.run_dir={run}"]))))
    (run / "checkpoints" / "step_00000002" / "meta.json").write_text(json.dumps({"format_version": "x"})[:-3])
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(run)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "meta.json" in err and "Traceback" not in err


def test_delta_directory_clear_keeps_other_files(tmp_path):
    from megatron_logra.sync.transport import DirectoryTransport, delta_filename

    t = DirectoryTransport(tmp_path)
    (tmp_path / delta_filename(3)).write_bytes(b"x")
    (tmp_path / f".{delta_filename(4)}.123.abcd.tmp").write_bytes(b"y")
    (tmp_path / "important.txt").write_text("keep")
    assert t.clear() == [f".{delta_filename(4)}.123.abcd.tmp", delta_filename(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["important.txt"]
    (tmp_path / "afile").write_text("z")
    with pytest.raises(ValueError, match="not a directory"):
        DirectoryTransport(tmp_path / "afile")


def test_an_unreadable_delta_file_is_a_sync_error_naming_it_once(tmp_path):
    from megatron_logra.sync import SyncError
    from megatron_logra.sync.transport import DirectoryTransport, delta_filename

    t = DirectoryTransport(tmp_path)
    (tmp_path / delta_filename(1)).mkdir()  # a folder where the delta should be
    with pytest.raises(SyncError, match=rf"{delta_filename(1)}: cannot be read \(IsADirectoryError") as err:
        t.read(1)
    assert err.value.kind == "unreadable"
    (tmp_path / delta_filename(1)).rmdir()
    (tmp_path / delta_filename(1)).write_bytes(b"\x00" * 5)  # truncated
    with pytest.raises(SyncError) as err:
        t.read(1)
    assert str(err.value).count(f"[{err.value.kind}]") == 1 and delta_filename(1) in str(err.value)
    assert err.value.kind == "truncated"


def test_a_start_refused_after_the_claim_leaves_no_directory_it_created(tmp_path, capsys):
    """A check after the run directory was claimed (here: the reward function cannot be imported) refuses the
    start; the directory the job created goes again, while one that was there before stays."""
    from megatron_logra.cli import main

    created = tmp_path / "new" / "run"
    existing = tmp_path / "existing"
    existing.mkdir()
    for run in (created, existing):
        with pytest.raises(SystemExit) as exc:
            main(["train", "tiny", f"train.run_dir={run}", "rl.steps=1", "train.progress=false",
                  "task.reward=no_such_reward_module:score"])
        assert exc.value.code == 2
        assert "cannot import module 'no_such_reward_module'" in capsys.readouterr().err
    assert not created.exists() and created.parent.is_dir()
    assert existing.is_dir() and not any(existing.iterdir())


def test_a_job_refused_the_lock_never_removes_the_directory_another_job_holds(tmp_path):
    """Two jobs started at once on a directory that did not exist: both saw it missing, one created and locked
    it; the other, refused, must not remove that (still empty) directory from under it."""
    import subprocess
    import sys

    from megatron_logra.checkpoint import run_dir as run_dir_module

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; os.mkdir(sys.argv[1]); fd = os.open(sys.argv[1], "
         "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)", str(run)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        run_dir_module._CREATED.add(str(run.absolute()))  # this job, too, found no directory there
        with pytest.raises(ValueError, match="in use by another running job"):
            claim_run_dir(run, resume=False, overwrite=False)
        run_dir_module.release_run_dir(run, failed=True)
        assert run.is_dir()
    finally:
        holder.kill()
        holder.wait()
