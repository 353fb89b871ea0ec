"""A resumed / evaluated run's saved config is validated once, after the command-line overrides: an override can
fix a saved value that this machine refuses (a run trained with ``model.transformer_impl=transformer_engine``,
read on a machine without Transformer Engine), while a saved config that stays invalid is still refused."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from megatron_logra.cli import main
from support.run_fixtures import fake_run_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                reason="needs a machine without transformer_engine")


def _te_run(run):
    fake_run_dir(run)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["model"]["transformer_impl"] = "transformer_engine"
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    meta_path = run / "checkpoints" / "step_00000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"] = data
    meta_path.write_text(json.dumps(meta))


def test_override_fixes_a_saved_config_this_machine_refuses(tmp_path, capsys):
    run = tmp_path / "run"
    _te_run(run)
    assert main(["config", "--resume", str(run), "model.transformer_impl=local"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["model"]["transformer_impl"] == "local"
    assert out["train"]["run_dir"] == str(run)


def test_without_the_override_the_saved_config_is_still_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _te_run(run)
    with pytest.raises(SystemExit) as info:
        main(["config", "--resume", str(run)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "transformer_engine is not installed" in err and "model.transformer_impl" in err
    assert "Traceback" not in err


def test_an_override_that_does_not_fix_it_is_refused_naming_the_saved_file(tmp_path, capsys):
    run = tmp_path / "run"
    _te_run(run)
    with pytest.raises(SystemExit) as info:
        main(["config", "--resume", str(run), "train.log_interval=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config.yaml" in err and "transformer_engine is not installed" in err
