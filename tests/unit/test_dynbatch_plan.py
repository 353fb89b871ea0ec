"""Dynamic micro-batches (``rl.max_tokens_per_micro_batch``): the plan covers every row once, each micro-batch
fits the token budget and holds every loss position of its rows, cutting and scattering back are inverses, and a
masked per-token sum over the micro-batches equals the whole batch's; the fixed plan is ``torch.split`` of the
rows at full length."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_logra.rl.batching import (pack_sequences, plan_microbatches, scatter_rows, split_microbatches,
                                        take_microbatch)


def _batch(lengths: list[int], prompt: int = 3, seed: int = 0, multiple: int = 8):
    gen = random.Random(seed)
    prompts = [[gen.randrange(1, 50) for _ in range(prompt)] for _ in lengths]
    completions = [[gen.randrange(1, 50) for _ in range(n)] for n in lengths]
    return pack_sequences(prompts, completions, rollout_logprobs=[[-gen.random() for _ in c] for c in completions],
                          advantages=[gen.uniform(-1, 1) for _ in lengths], finished=[n % 2 == 0 for n in lengths],
                          pad_id=0, max_length=256, multiple=multiple)


def _last_loss_position(mask_S: torch.Tensor) -> int:
    """One past the last loss position, by a plain loop (0 without one)."""
    end = 0
    for i, v in enumerate(mask_S.tolist()):
        if v > 0:
            end = i + 1
    return end


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_covers_every_row_once_and_fits_the_budget(seed):
    gen = random.Random(seed)
    lengths = [gen.choice([0, 1, 2, 5, 9, 17, 40, 120]) for _ in range(gen.randrange(1, 30))]
    multiple = gen.choice([1, 8, 16])
    batch = _batch(lengths, seed=seed, multiple=multiple)
    budget = gen.choice([16, 64, 200, 1000])
    plan = plan_microbatches(batch, micro_batch_size=4, max_tokens=budget, multiple=multiple)
    rows = [r for part in plan for r in part.rows]
    assert sorted(rows) == list(range(len(lengths)))
    s = batch.tokens.shape[1]
    for part in plan:
        assert list(part.rows) == sorted(part.rows)
        assert part.length <= s and (part.length % multiple == 0 or part.length == s)
        assert len(part.rows) * part.length <= budget or len(part.rows) == 1
        for r in part.rows:
            assert _last_loss_position(batch.loss_mask[r]) <= part.length
    # the longest row sets its micro-batch's length: no micro-batch is longer than needed
    for part in plan:
        need = max(max(_last_loss_position(batch.loss_mask[r]) for r in part.rows), 1)
        assert part.length == min(s, -(-need // multiple) * multiple)


def test_short_rows_are_not_padded_to_the_longest():
    batch = _batch([120] + [4] * 31)
    fixed = split_microbatches(batch, 8)
    dynamic = split_microbatches(batch, 8, max_tokens=200)
    fixed_positions = sum(b.tokens.numel() for b in fixed)
    dynamic_positions = sum(b.tokens.numel() for b in dynamic)
    assert fixed_positions == 32 * batch.tokens.shape[1]
    assert dynamic_positions < fixed_positions / 5
    assert dynamic[0].tokens.shape[0] == 1  # the long row alone
    assert {b.tokens.shape[1] for b in dynamic[1:]} == {8}


def test_cutting_and_scattering_back_are_inverses_on_the_loss_positions():
    batch = _batch([30, 2, 17, 0, 9, 64, 5], seed=3)
    plan = plan_microbatches(batch, 2, max_tokens=64)
    parts = [take_microbatch(batch, part) for part in plan]
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        back = scatter_rows([getattr(p, name).double() for p in parts], plan, tuple(batch.tokens.shape))
        mask = batch.loss_mask > 0
        assert torch.equal(back[mask], getattr(batch, name).double()[mask])
    for key in batch.extras:
        back = scatter_rows([p.extras[key] for p in parts], plan, tuple(batch.tokens.shape))
        assert torch.equal(back * batch.loss_mask, batch.extras[key] * batch.loss_mask)
    with pytest.raises(ValueError, match="micro-batch results"):
        scatter_rows([parts[0].tokens], plan, tuple(batch.tokens.shape))


def test_a_masked_token_sum_over_dynamic_micro_batches_equals_the_whole_batch():
    batch = _batch([30, 2, 17, 0, 9, 64, 5, 11, 11], seed=4)
    weight = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def masked_sum(b):
        per_token = weight[b.labels % 64] * b.extras["advantages"].double() + b.position_ids.double()
        return (per_token * b.loss_mask.double()).sum()

    whole = masked_sum(batch)
    for budget in (8, 40, 100, 10_000):
        parts = split_microbatches(batch, 3, max_tokens=budget)
        assert sum(masked_sum(p) for p in parts).item() == pytest.approx(whole.item(), rel=1e-12)
        assert sum(int(p.loss_mask.sum()) for p in parts) == int(batch.loss_mask.sum())


def test_the_fixed_plan_is_consecutive_rows_at_full_length():
    batch = _batch([3, 8, 1, 20, 7], seed=5)
    parts = split_microbatches(batch, 2)
    want = torch.split(batch.tokens, 2)
    assert len(parts) == len(want)
    for p, w in zip(parts, want):
        assert torch.equal(p.tokens, w)
        assert p.tokens.data_ptr() == w.data_ptr()  # views, as before: no copy of the step's batch


def test_bad_arguments_are_refused():
    batch = _batch([3, 4])
    with pytest.raises(ValueError, match="max_tokens=-1"):
        plan_microbatches(batch, 2, max_tokens=-1)
