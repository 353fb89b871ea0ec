"""The step record's ``padding_share`` is the share of the positions the micro-batches computed that hold no token
of a sequence, also where the engine returned empty completions (a server may): such a row is all padding when
packed, and with a token budget it is cut to one sequence multiple whatever its prompt's length."""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class _EmptyEvery:
    """The embedded engine, with every ``k``-th rollout's completion emptied (not finished)."""

    def __init__(self, engine, k):
        self.engine, self.k = engine, k

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        from megatron_logra.rollout.engine import Rollout

        out = self.engine.generate(prompts, params)
        return [Rollout(r.prompt_ids, [], [], False, r.weight_version) if i % self.k == 0 else r
                for i, r in enumerate(out)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from support.run_fixtures import rl_components

    with rl_components(tmp_path_factory.mktemp("padshare") / "run", [
            "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=4",
            "task.num_eval=0"]) as built:
        yield built


@pytest.mark.parametrize("budget", [0, 48])
def test_padding_share_counts_empty_completions_as_padding(built, monkeypatch, budget):
    from megatron_logra.rl.batching import plan_microbatches
    from megatron_logra.rl.loop import rl_update
    from support.step_spies import record_packing

    comps, state = built
    monkeypatch.setattr(comps.cfg.rl, "max_tokens_per_micro_batch", budget)
    monkeypatch.setattr(comps, "engine", _EmptyEvery(comps.engine, 2))
    counter = itertools.count()
    monkeypatch.setattr(comps.task, "score", lambda problem, completion: (float(next(counter) % 2), False))
    calls = record_packing(monkeypatch)
    record = rl_update(comps, state)
    (call,) = calls
    batch = call["batch"]
    assert any(not c for c in call["completions"]) and any(call["completions"])
    # reference: per micro-batch row, the positions holding a token of its sequence (prompt + completion, minus
    # the last); an empty completion's row is packed as padding only
    plan = plan_microbatches(batch, comps.cfg.rl.micro_batch_size, budget, comps.cfg.sequence_multiple())
    positions = sum(len(p.rows) * p.length for p in plan)
    real = 0
    for part in plan:
        for row in part.rows:
            prompt, completion = call["prompts"][row], call["completions"][row]
            if completion:
                real += min(part.length, len(prompt) + len(completion) - 1)
    assert record["train_positions"] == positions
    assert 0.0 <= record["padding_share"] <= 1.0
    assert record["padding_share"] == pytest.approx(1.0 - real / positions)
