"""The deprecated ``train.eval_batches`` replaces ``train.eval_sequences``: giving eval_sequences while
eval_batches is set (on the same command line, or in a resumed run's config) is refused, naming both."""

from __future__ import annotations

import pytest
import yaml

from megatron_logra.cli import main
from megatron_logra.config import parse_args_to_config
from support.run_fixtures import fake_run_dir


def test_both_given_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"train\.eval_sequences=10 is given.*train\.eval_batches=2 replaces it.*"
                                         r"train\.eval_batches=null"):
        parse_args_to_config("lm-tiny", ["train.eval_batches=2", "train.eval_sequences=10"])


def test_eval_sequences_with_eval_batches_null_passes():
    cfg = parse_args_to_config("lm-tiny", ["train.eval_batches=null", "train.eval_sequences=10"])
    assert (cfg.train.eval_batches, cfg.train.eval_sequences) == (None, 10)
    assert parse_args_to_config("lm-tiny", ["train.eval_batches=2"]).train.eval_batches == 2


def test_resumed_run_with_eval_batches_refuses_a_given_eval_sequences(tmp_path, capsys):
    run = tmp_path / "run"
    fake_run_dir(run)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["train"]["eval_batches"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SystemExit) as info:
        main(["config", "--resume", str(run), "train.eval_sequences=128"])
    assert info.value.code == 2
    assert "in the resumed run's config" in capsys.readouterr().err
    assert main(["config", "--resume", str(run), "train.eval_sequences=128", "train.eval_batches=null"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert (out["train"]["eval_batches"], out["train"]["eval_sequences"]) == (None, 128)
