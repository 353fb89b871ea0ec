"""``rl.max_tokens_per_micro_batch`` in the RL step (CPU megatron GPT, LoGRA, a frozen reference): the reference
log-probs, the losses and reports, and the prepared update (every target's direction) equal those of fixed
micro-batches of the same rows, up to the order of float sums, while the micro-batches cover far fewer positions
(the optimizer's state advances with each ``prepare``, so the stateless parts are compared: the reduced gradient
sketch of every target and the dense gradients of the other parameters); and a whole step with a token budget
trains."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from support.run_fixtures import rl_components

    with rl_components(tmp_path_factory.mktemp("dynbatch") / "run", [
            "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=4",
            "task.num_eval=0", "rl.loss.kl_coef=0.05", "rl.loss.entropy_coef=0.01"]) as built:
        yield built


def _skewed_batch(comps):
    """Twelve sequences: two near the context length, the rest a few tokens; random advantages and log-probs."""
    from megatron_logra.rl.batching import pack_sequences

    gen = random.Random(0)
    vocab = len(comps.tokenizer)
    lengths = [40, 3, 2, 5, 1, 36, 4, 3, 0, 6, 2, 4]
    prompts = [[gen.randrange(1, vocab) for _ in range(gen.randrange(2, 6))] for _ in lengths]
    completions = [[gen.randrange(1, vocab) for _ in range(n)] for n in lengths]
    return pack_sequences(prompts, completions, rollout_logprobs=[[-gen.uniform(0.5, 5) for _ in c] for c in completions],
                          advantages=[gen.uniform(-1, 1) for _ in lengths], finished=[n % 3 > 0 for n in lengths],
                          pad_id=comps.tokenizer.pad_token_id, max_length=comps.cfg.model.seq_length,
                          multiple=comps.cfg.sequence_multiple())


def _step_parts(comps, batch, budget: int):
    from megatron_logra.profiling.phases import Phases
    from megatron_logra.rl.objective import _reference_logprobs, backward_and_prepare, make_rl_loss_fn, step_plan

    comps.cfg.rl.max_tokens_per_micro_batch = budget
    try:
        batch = type(batch)(batch.tokens, batch.labels, batch.loss_mask, batch.position_ids, dict(batch.extras))
        ref = _reference_logprobs(comps, batch)
        batch.extras["ref_logprobs"] = ref
        positions = sum(len(p.rows) * p.length for p in step_plan(comps, batch))
        loss_fn = make_rl_loss_fn(comps.cfg.rl.loss, comps.cfg.rl.rollout.temperature, comps.groups.tp)
        with Phases("test") as ph:
            result, update, _ = backward_and_prepare(comps, batch, loss_fn, 1, ph)
        sketches = {t.key: t.sketch.clone() for t in comps.optimizer.targets}
        return ref, result, update, positions, sketches
    finally:
        comps.cfg.rl.max_tokens_per_micro_batch = 0


def test_a_token_budget_gives_the_fixed_micro_batches_update(built):
    comps, _ = built
    batch = _skewed_batch(comps)
    ref_fixed, fixed, update_fixed, positions_fixed, sketch_fixed = _step_parts(comps, batch, 0)
    ref_dyn, dyn, update_dyn, positions_dyn, sketch_dyn = _step_parts(comps, batch, 64)
    assert positions_dyn < positions_fixed / 2

    mask = batch.loss_mask > 0
    torch.testing.assert_close(ref_dyn[mask], ref_fixed[mask], rtol=1e-5, atol=1e-5)
    assert fixed.num_tokens == dyn.num_tokens == int(batch.loss_mask.sum())
    assert set(fixed.reports) == set(dyn.reports) == {"lm", "mismatch", "entropy", "ref_kl"}
    for name in fixed.reports:
        torch.testing.assert_close(dyn.reports[name], fixed.reports[name], rtol=1e-5, atol=1e-5)
    assert fixed.reports["ref_kl"][1] > 0  # the reference took part
    assert not update_fixed.skipped and not update_dyn.skipped
    assert set(sketch_fixed) == set(sketch_dyn) and sketch_fixed
    for key, d in sketch_fixed.items():
        scale = d.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(sketch_dyn[key], d, rtol=1e-4, atol=1e-5 * scale)
    assert update_dyn.grad_norm == pytest.approx(update_fixed.grad_norm, rel=1e-4)


def test_a_whole_step_with_a_token_budget_trains(built, monkeypatch):
    from megatron_logra.rl.loop import rl_update

    comps, state = built
    monkeypatch.setattr(comps.cfg.rl, "max_tokens_per_micro_batch", 48)
    returned: list[float] = []

    def score(problem, completion):
        reward = float(len(returned) % 2 == 0)
        returned.append(reward)
        return reward, reward == 1.0

    monkeypatch.setattr(comps.task, "score", score)
    params = {n: p.detach().clone() for n, p in comps.model.named_parameters()}
    record = rl_update(comps, state)
    assert not record["skipped"] and math.isfinite(record["loss"])
    assert any(not torch.equal(p.detach(), params[n]) for n, p in comps.model.named_parameters())
