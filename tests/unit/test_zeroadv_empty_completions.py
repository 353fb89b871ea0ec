"""A step whose nonzero advantages all belong to empty completions trains on nothing (no loss token carries one):
it is skipped as a step of zero advantages, weights untouched, as a step of uniform groups is, rather than
handing the optimizer a zero gradient it would still step with."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class _EmptyOdd:
    """The embedded engine with every odd rollout's completion emptied."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        from megatron_logra.rollout.engine import Rollout

        out = self.engine.generate(prompts, params)
        return [Rollout(r.prompt_ids, [], [], False, r.weight_version) if i % 2 else r for i, r in enumerate(out)]


def test_nonzero_advantages_on_empty_completions_only_skip_the_step(tmp_path, monkeypatch):
    from support.run_fixtures import rl_components

    from megatron_logra.rl.loop import rl_update

    with rl_components(tmp_path / "run", ["rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4",
                                          "rl.micro_batch_size=16", "task.num_eval=0",
                                          "rl.advantage.baseline=none"]) as (comps, state):
        monkeypatch.setattr(comps, "engine", _EmptyOdd(comps.engine))
        # the raw rewards are the advantages: 1 for an empty completion, 0 for every other
        monkeypatch.setattr(comps.task, "score", lambda problem, completion: (float(completion.strip() == ""), False))
        params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
        record = rl_update(comps, state)
        assert record["skipped"] and record["skip_reason"] == "zero advantages"
        assert all(torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())
