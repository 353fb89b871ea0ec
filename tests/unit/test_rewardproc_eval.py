"""``megatron-logra eval RUN task.reward_workers=N`` scores the held-out set in worker processes, gives the accuracy
of in-process scoring, and leaves no worker behind when it returns (the command closes the pools it started)."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from support.cli import eval_ok
from support.run_fixtures import run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def test_eval_with_reward_workers_matches_in_process_and_closes_them(tmp_path, capsys, one_thread):
    run = tmp_path / "run"
    run_rl_recipe("tiny", [
        "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64",
        "sft.init_path=", "sft.steps=2", "sft.batch_size=4", "sft.cache=false", "tokenizer.path=",
        "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch_size=4",
        "task.num_eval=6", "rl.eval_interval=0", "kl.probe_sequences=1", "kl.probe_max_tokens=2",
        f"train.run_dir={run}", "train.progress=false"])
    capsys.readouterr()
    eval_ok(run)
    in_process = json.loads(capsys.readouterr().out)
    before = {p.pid for p in multiprocessing.active_children()}
    eval_ok(run, "task.reward_workers=2")
    in_workers = json.loads(capsys.readouterr().out)
    assert in_workers["eval_accuracy"] == in_process["eval_accuracy"] and in_workers["num_eval"] == 6
    assert {p.pid for p in multiprocessing.active_children()} - before == set()
