"""A bare ``--resume`` (or ``train.resume=true``) whose run directory has a broken ``checkpoints/latest`` is
reported as ``megatron-logra: error: ...`` with exit status 2 before anything is built, as the
``--resume RUN_DIR`` form is; it was a ``CheckpointError`` traceback."""

from __future__ import annotations

import pytest

from megatron_logra.cli import main


@pytest.mark.parametrize("argv", [
    ["train", "tiny", "--resume"],
    ["train", "lm-tiny", "train.resume=true"],
])
def test_a_broken_latest_with_a_bare_resume_is_a_user_error(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.delenv("MEGATRON_LOGRA_TRACEBACK", raising=False)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000009")
    with pytest.raises(SystemExit) as info:
        main([*argv, f"train.run_dir={run}"])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith("megatron-logra: error: ") and "step_00000009" in err and "Traceback" not in err
    assert not (run / "config.yaml").exists()  # nothing was started
