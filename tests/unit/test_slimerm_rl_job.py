"""A short ``tiny`` RL run whose reward is a slime reward function (``task.reward=slime:package.module.function``,
slime's ``--custom-rm-path`` spelling): every logged sample's reward is the function's -1 / 1 as it returned it,
``correct`` is reward >= ``task.correct_reward``, and the function saw the run's ``rl.group_size`` as
``args.n_samples_per_prompt``. CPU, real components, no mocks."""

from __future__ import annotations

import json

import pytest

from support.jsonl_rows import plugin_and_file
from support.run_fixtures import SMALL_RL, run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

SLIME_RM = '''
async def odd_answer(args, sample):
    """1 for a problem of odd answer, else -1 (both occur whatever the model writes); refuses a wrong group size."""
    if args.n_samples_per_prompt != 2 or not sample.metadata["source"].endswith("p.jsonl"):
        raise ValueError(f"args.n_samples_per_prompt={args.n_samples_per_prompt}, source {sample.metadata}")
    return 1.0 if int(sample.label) % 2 else -1.0
'''


def test_a_tiny_run_trains_on_a_slime_reward(tmp_path, monkeypatch):
    name, data = plugin_and_file(tmp_path, monkeypatch, SLIME_RM, "mlogra_slimerm_job")
    run = tmp_path / "run"
    summary = run_rl_recipe("tiny", [*SMALL_RL, f"train.run_dir={run}", f"task.datasets=jsonl:{data}",
                                     f"task.reward=slime:{name}.odd_answer", "task.num_eval=0", "rl.steps=1",
                                     "rl.log_samples=16", "rl.group_size=2", "rl.prompts_per_step=8",
                                     "rl.micro_batch_size=16"])
    assert summary["steps"] == 1
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    answers = {f"{i}+1=": i + 1 for i in range(40)}
    train = [s for s in samples if s["split"] == "train"]
    assert len(train) == 16
    for s in train:
        odd = answers[s["prompt"]] % 2 == 1
        assert (s["reward"], s["correct"]) == ((1.0, True) if odd else (-1.0, False)), s
    assert {s["reward"] for s in train} == {1.0, -1.0}

