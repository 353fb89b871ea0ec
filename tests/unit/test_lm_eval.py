"""Held-out evaluation of the LM job: the same eval batches 0 .. n-1 for every data-parallel layout, and the
returned loss is the per-answer-token mean cross-entropy computed here from the model's own logits."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

import megatron_logra.train.lm_eval as lm_eval
from megatron_logra.config import lm_tiny
from megatron_logra.data.synthetic import SyntheticTask


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9])
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_every_eval_batch_is_evaluated_once_and_ranks_run_alike(n, dp):
    per_rank = [lm_eval.eval_assignment(n, dp, r) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) >= 1  # same count: collectives match
    real = sorted(i for p in per_rank for i in p if i is not None)
    assert real == list(range(n))


@pytest.fixture(scope="module")
def lm_model(groups, one_thread):
    """The lm-tiny model (initialised with std 0.3, so per-token losses differ well beyond rounding) and its
    LoGRA optimizer (whose sketches ``evaluate`` pauses)."""
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import build_optimizer

    cfg = lm_tiny()
    cfg.model.init_std = 0.3
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed)
    return cfg, model, build_optimizer(model, cfg.optimizer, groups)


def reference_sums(model, batches) -> tuple[float, float]:
    """(Σ loss_mask · cross-entropy of the labels, Σ loss_mask) in float64 from plain forwards in eval mode."""
    was_training = model.training
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            logits = model(b.tokens, b.position_ids, None).double()  # [b, s, V]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.labels.reshape(-1), reduction="none")
            total += (ce * b.loss_mask.reshape(-1).double()).sum().item()
            count += b.loss_mask.sum().item()
    model.train(was_training)
    return total, count


def dp_rank_view(groups, dp: int, rank: int):
    """The one-process groups seen as rank ``rank`` of ``dp``: ``evaluate`` picks that rank's batches, and
    ``forward_backward`` sums over the real one-rank DP group (this rank's part alone)."""
    return types.SimpleNamespace(tp=groups.tp, pp=groups.pp, dp=groups.dp, pp_size=groups.pp_size,
                                 pp_last=groups.pp_last, dp_size=dp, dp_rank=rank)


@pytest.mark.parametrize("n, dp", [(4, 1), (5, 2), (1, 3), (4, 8)])
def test_eval_loss_is_the_masked_mean_cross_entropy_of_batches_0_to_n(lm_model, groups, monkeypatch, n, dp):
    """Every DP layout feeds exactly eval batches 0 .. n-1 (padding micro-batches count no token) through
    the real forward, and the losses add up to the per-answer-token mean cross-entropy of those batches."""
    cfg, model, optimizer = lm_model
    cfg.train.eval_batches = n
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    want_batches = [task.microbatch(0, i, cfg.train.micro_batch_size, split="eval") for i in range(n)]
    want_sum, want_tokens = reference_sums(model, want_batches)
    unmasked = reference_sums(model, [dataclasses.replace(b, loss_mask=torch.ones_like(b.loss_mask)) for b in want_batches])
    # the answer-token mean differs from the every-token mean by 100x the tolerance below: the check tells them apart
    assert abs(unmasked[0] / unmasked[1] - want_sum / want_tokens) > 1e-3 * (want_sum / want_tokens)

    calls = []
    real = lm_eval.forward_backward

    def spy(model_, mbs, groups_, **kwargs):
        result = real(model_, mbs, groups_, **kwargs)
        calls.append((mbs, kwargs, result))
        return result

    monkeypatch.setattr(lm_eval, "forward_backward", spy)
    model.train()
    losses = []
    for r in range(dp):
        losses.append(lm_eval.evaluate(model, task, cfg, dp_rank_view(groups, dp, r), optimizer))
        assert model.training  # back in training mode
    assert len(calls) == dp and all(kw.get("forward_only") for _, kw, _ in calls)

    # the batches: the same count on every rank, batch i on rank i % dp, the rest all-masked padding
    fed = [mbs for mbs, _, _ in calls]
    assert len({len(mbs) for mbs in fed}) == 1
    for r, mbs in enumerate(fed):
        counted = [b for b in mbs if b.loss_mask.sum() > 0]
        mine = want_batches[r::dp]
        assert [b.tokens.tolist() for b in counted] == [b.tokens.tolist() for b in mine]
        assert all(torch.equal(b.loss_mask, w.loss_mask) for b, w in zip(counted, mine))
        for b in mbs[len(counted):]:
            assert b.tokens.shape == want_batches[0].tokens.shape and not torch.any(b.loss_mask)
        # each rank's loss: the mean over its own batches (a rank with padding only counts no token)
        own_sum, own_tokens = reference_sums(model, mine)
        result = calls[r][2]
        assert result.global_tokens == own_tokens
        assert result.loss_sum == pytest.approx(own_sum, rel=1e-5, abs=1e-9)
        assert losses[r] == result.loss

    total = sum(res.loss_sum for _, _, res in calls)
    tokens = sum(res.global_tokens for _, _, res in calls)
    assert tokens == want_tokens == n * cfg.train.micro_batch_size * cfg.data.content_length
    assert total / tokens == pytest.approx(want_sum / want_tokens, rel=1e-5)
    if dp == 1:
        assert losses[0] == pytest.approx(want_sum / want_tokens, rel=1e-5)


def test_bad_assignments_are_refused():
    with pytest.raises(ValueError):
        lm_eval.eval_assignment(4, 2, 2)
