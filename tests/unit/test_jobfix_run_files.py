"""The files a job writes into its run directory besides checkpoints and metrics: ``config.yaml`` and
``summary.json`` are replaced atomically (a synced temporary file renamed over the old one: a kill or a
full disk mid-write leaves the old file or the new one, never a truncated one, which ``--resume`` would
read with defaults for the missing sections), and the LM job writes ``summary.json`` as the RL job does.

A rename gives the path a new inode; rewriting in place (truncate, then write) keeps it."""

from __future__ import annotations

import json
import warnings

from megatron_logra.cli import main

LM_SMALL = ["train.progress=false", "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=0",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


def _inodes(run) -> dict:
    return {name: (run / name).stat().st_ino for name in ("config.yaml", "summary.json")}


def test_the_lm_job_writes_its_summary_and_replaces_config_and_summary_atomically(tmp_path, capsys, one_thread):
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", *LM_SMALL]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((run / "summary.json").read_text()) == printed and printed["steps"] == 2
    before = _inodes(run)

    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((run / "summary.json").read_text()) == printed
    assert (printed["steps"], printed["segment_steps"]) == (3, 1)
    after = _inodes(run)
    assert all(after[name] != before[name] for name in before), (before, after)  # renamed over, not rewritten
    assert not list(run.glob("*.tmp"))


def test_the_rl_job_replaces_config_and_summary_atomically(tmp_path, one_thread):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl

    run = tmp_path / "run"
    base = [f"train.run_dir={run}", "train.progress=false", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=4",
            "rl.eval_interval=0", "task.num_eval=4"]
    before = None
    for extra in ([], ["train.resume=true"]):  # the resumed run is at rl.steps already: nothing to train
        destroy_parallel()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                summary = run_rl(parse_args_to_config("tiny", base + extra))
        finally:
            destroy_parallel()
        assert json.loads((run / "summary.json").read_text()) == json.loads(json.dumps(summary))
        if before is None:
            before = _inodes(run)
    after = _inodes(run)
    assert all(after[name] != before[name] for name in before), (before, after)
    assert not list(run.glob("*.tmp"))
