"""``pass_at_group`` in each RL step's record (slime's ``--log-passrate`` pass@n, n = ``rl.group_size``): the share
of the step's prompts with at least one correct sample among their group, summed over DP ranks; checked on one
step of the real CPU components against a hand-computed value."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

G, P = 4, 3


def test_pass_at_group_is_the_share_of_groups_with_a_correct_sample(tmp_path):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import rl_update

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = parse_args_to_config("tiny", [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "sft.steps=2", "sft.init_path=",
        "tokenizer.path=", "sft.cache=false", "rl.steps=1", f"rl.prompts_per_step={P}", f"rl.group_size={G}",
        "rl.micro_batch_size=12", "task.num_eval=2", "rl.eval_interval=0", f"train.run_dir={tmp_path / 'run'}",
        "train.progress=false", "--log-passrate",
    ])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            comps, state, _ = build_components(cfg)
        # the step's samples are scored in order, group after group: group 0 has one correct sample, group 1
        # none, group 2 all four -> pass@4 = 2/3 of the prompts; accuracy (pass@1) = 5/12 of the samples
        correct = [True, False, False, False] + [False] * G + [True] * G
        counter = itertools.count()
        comps.task.score = lambda problem, completion: (lambda ok: (1.0 if ok else 0.0, ok))(correct[next(counter)])
        record = rl_update(comps, state)
    finally:
        destroy_parallel()
        torch.set_num_threads(before)
    assert next(counter) == P * G  # every sample was scored once, by the function above
    assert record["pass_at_group"] == pytest.approx(2 / 3)
    assert record["accuracy"] == pytest.approx(5 / 12)
