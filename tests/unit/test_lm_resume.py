"""Resuming the LM job with train.steps below the checkpoint's step is refused, naming train.steps,
before anything in the run directory changes; train.steps equal to it trains nothing and reports
the whole run's summary again (valid JSON, never NaN)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.cli import main

SMALL = ["train.progress=false", "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=0",
         "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_below_the_checkpoint_step_is_refused_and_nothing_changes(tmp_path, capsys, one_thread):
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=3", *SMALL]) == 0
    capsys.readouterr()
    before = _files(run)
    assert "steps: 3" in (run / "config.yaml").read_text()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", str(run), "train.steps=1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "train.steps=1" in err and "step 3" in err and "Traceback" not in err
    assert _files(run) == before  # config.yaml, metrics and checkpoints untouched

    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0  # at the checkpoint: nothing to train
    summary = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"summary holds {c}"))
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert (summary["steps"], summary["segment_steps"]) == (3, 0)  # the whole run's, though this one trained none
    assert (summary["first_loss"], summary["last_loss"]) == (losses[1], losses[3])


def test_the_lm_job_writes_no_api_key_to_disk(tmp_path, capsys, one_thread):
    """A credential given on the command line (``rl.rollout.sglang_api_key``) never reaches an LM run's files:
    the LM job does not read ``rl.*``, so the setting is refused (exit 2, naming it) before anything is
    written, and a run in the same directory afterwards holds no trace of it."""
    run, secret = tmp_path / "run", "sk-lm-secret-4711"
    with pytest.raises(SystemExit) as exit_:
        main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", f"rl.rollout.sglang_api_key={secret}",
              *SMALL])
    assert exit_.value.code == 2 and "rl.rollout.sglang_api_key" in capsys.readouterr().err
    assert not run.exists() or [n for n, d in _files(run).items() if secret.encode() in d] == []
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", *SMALL]) == 0
    files = _files(run)
    assert "config.yaml" in files and any(name.endswith("meta.json") for name in files)
    assert [name for name, data in files.items() if secret.encode() in data] == []

