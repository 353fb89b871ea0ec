"""``train --resume RUN`` of a run saved at TP2, launched on 2 processes with ``--pipeline-model-parallel-size 2``:
TP2 × PP2 does not fit, and the error names the override that fits while keeping the PP2 asked for
(``--tensor-model-parallel-size 1``). It used to name ``--pipeline-model-parallel-size 1`` too, undoing the size
given on the command line."""

from __future__ import annotations

import pytest
import yaml

from megatron_logra.cli.run_dir import run_dir_config
from support.run_fixtures import fake_run_dir


@pytest.fixture
def tp2_run(tmp_path, monkeypatch):
    """A run saved at TP2 (config.yaml and its checkpoint's copy) and a launch of 2 processes (torchrun's
    variables; no process group is started before the layout check)."""
    run = tmp_path / "run"
    fake_run_dir(run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["parallel"]["tp"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    return run


def test_the_hint_keeps_a_given_size_that_fits(tp2_run):
    with pytest.raises(ValueError) as info:
        run_dir_config(tp2_run, ["--pipeline-model-parallel-size", "2"])
    err = str(info.value)
    assert f"parallel.tp=2 (from {tp2_run / 'config.yaml'}) and parallel.pp=2 (given)" in err
    assert "add --tensor-model-parallel-size 1 (or parallel.tp=1)," in err, err
    assert "pipeline-model-parallel-size 1" not in err and "parallel.pp=1" not in err, err
    # the named override fits
    cfg = run_dir_config(tp2_run, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (1, 2)


def test_a_given_size_that_does_not_fit_by_itself_is_named_too(tp2_run):
    with pytest.raises(ValueError) as info:
        run_dir_config(tp2_run, ["--tensor-model-parallel-size", "4"])
    err = str(info.value)
    assert "parallel.tp=4 (given)" in err and "add --tensor-model-parallel-size 1 (or parallel.tp=1)," in err, err
