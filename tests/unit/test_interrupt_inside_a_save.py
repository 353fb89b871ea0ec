"""A Ctrl-C that lands inside library code under way (a checkpoint save: torch's writer, interrupted while it held
a lock, raised ``AssertionError: attempt to release recursive lock not owned by thread``, which the save reports
as its own failure) is still reported as the Ctrl-C: exit status 130 and the line naming how to resume, not
"saving checkpoint failed" with status 2. An error with no Ctrl-C behind it is reported as before."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_logra.checkpoint.integrity import CheckpointError
from megatron_logra.cli import main

SAVE_ERROR = ("saving checkpoint step 8 failed on rank 0 (AssertionError: attempt to release recursive lock not "
              "owned by thread) while writing the sharded tensors")


def _run_interrupted_inside_a_save(cfg):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises KeyboardInterrupt here
    except KeyboardInterrupt:
        raise CheckpointError(SAVE_ERROR) from None  # what the writer made of it
    raise AssertionError("SIGINT was not delivered")


def _run_failing_without_interrupt(cfg):
    raise CheckpointError(SAVE_ERROR)


@pytest.mark.parametrize("run, status, words", [
    (_run_interrupted_inside_a_save, 130, "interrupted (Ctrl-C, SIGINT)"),
    (_run_failing_without_interrupt, 2, "saving checkpoint step 8 failed"),
])
def test_an_error_after_ctrl_c_is_the_ctrl_c(run, status, words, tmp_path, monkeypatch, capsys):
    import megatron_logra.train.lm as lm

    monkeypatch.setattr(lm, "run_lm", run)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exc:
            main(["train", "lm-tiny", f"train.run_dir={tmp_path / 'run'}"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert exc.value.code == status
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    if status == 130:
        assert "saving checkpoint" not in err, err
