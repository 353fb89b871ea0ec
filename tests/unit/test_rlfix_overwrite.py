"""RL job: ``train.overwrite=true`` deletes a previous run only after every check that can refuse the new
one. A prompt longer than ``model.seq_length`` is refused at start (naming the field), and the old run's
files stay as they were."""

from __future__ import annotations

import warnings

import pytest

PREVIOUS = {
    "checkpoints/step_00000003/meta.json": "{}",
    "checkpoints/latest": "step_00000003",
    "metrics.jsonl": '{"step": 1, "reward_mean": 0.5}\n',
    "summary.json": "{}",
    "config.yaml": "job: rl\n",
    "tensorboard/events.out": "x",
}


def test_a_refused_rl_run_keeps_the_run_that_overwrite_would_replace(tmp_path, capsys, caplog, one_thread):
    from megatron_logra.cli import main
    from megatron_logra.parallel import destroy_parallel

    run = tmp_path / "run"
    for rel, text in PREVIOUS.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    try:
        with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_:
            warnings.simplefilter("ignore")
            main(["train", "tiny", f"train.run_dir={run}", "train.overwrite=true", "model.seq_length=24",
                  "sft.init_path=", "sft.steps=1", "train.progress=false"])
    finally:
        destroy_parallel()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-2000:]
    assert "has no training prompts that fit" in err and "(model.seq_length=24," in err
    assert "removing the previous run" not in caplog.text
    for rel, content in PREVIOUS.items():
        assert (run / rel).read_text() == content, rel
    assert not (run / "tokenizer").exists()
