"""Resuming (or evaluating) a run with another architecture is an error naming the field, the checkpoint's
value and the new one (it was a 17-line torch CheckpointException about a tensor's global shape)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatron_logra.checkpoint import CheckpointError, save_checkpoint
from megatron_logra.checkpoint.load import load_checkpoint
from megatron_logra.cli import main
from megatron_logra.models.gpt import build_gpt
from support.run_fixtures import fake_run_dir
from test_checkpoint_checksums import MODEL


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _build(cfg, groups):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt(cfg, groups, seed=1)


def test_load_checkpoint_names_the_changed_field(groups, tmp_path):
    ckpt = save_checkpoint(tmp_path / "run", 2, _build(MODEL, groups), None, groups,
                           config={"model": dataclasses.asdict(MODEL)})
    wider = dataclasses.replace(MODEL, hidden_size=2 * MODEL.hidden_size)
    with pytest.raises(CheckpointError, match=rf"model\.hidden_size={MODEL.hidden_size} in the checkpoint, "
                                              rf"{wider.hidden_size} in this run"):
        load_checkpoint(ckpt, _build(wider, groups), None, groups, model_config=wider)
    # without the config, torch's shape error is still one line (it carried every rank's traceback)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, _build(wider, groups), None, groups)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    assert "shape mismatch" in str(info.value)




@pytest.mark.parametrize("argv", [
    ["train", "--resume", "{run}", "model.hidden_size=128"],
    ["train", "lm-tiny", "--resume", "train.run_dir={run}", "--hidden-size", "128"],
    ["eval", "{run}", "model.hidden_size=128"],
])
def test_cli_resume_with_another_architecture_exits_2_naming_the_field(argv, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = fake_run_dir(run)
    with pytest.raises(SystemExit) as info:
        main([a.format(run=run) for a in argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"model.hidden_size={cfg.model.hidden_size} in the checkpoint, 128 in this run" in err
    assert "Traceback" not in err
