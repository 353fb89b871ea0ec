"""Held-out evaluation of the LM job: the same eval batches 0 .. n-1 for every data-parallel layout."""

from __future__ import annotations

import types

import pytest
import torch

import megatron_logra.train.lm as lm
from megatron_logra.config import lm_tiny
from megatron_logra.data.synthetic import SyntheticTask


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9])
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_every_eval_batch_is_evaluated_once_and_ranks_run_alike(n, dp):
    per_rank = [lm.eval_assignment(n, dp, r) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) >= 1  # same count: collectives match
    real = sorted(i for p in per_rank for i in p if i is not None)
    assert real == list(range(n))


class _Model:
    def eval(self):
        pass

    def train(self):
        pass


@pytest.mark.parametrize("n, dp", [(5, 2), (1, 3), (4, 8), (4, 1)])
def test_evaluate_feeds_exactly_the_eval_batches_and_masks_the_padding(monkeypatch, n, dp):
    cfg = lm_tiny()
    cfg.train.eval_batches = n
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    fed = []
    monkeypatch.setattr(lm, "forward_backward",
                        lambda model, mbs, groups, forward_only=False: fed.append(mbs) or types.SimpleNamespace(loss=0.0))
    for r in range(dp):
        lm.evaluate(_Model(), task, cfg, types.SimpleNamespace(dp_size=dp, dp_rank=r), optimizer=None)
    assert len({len(mbs) for mbs in fed}) == 1
    counted = [b for mbs in fed for b in mbs if b.loss_mask.sum() > 0]
    padding = [b for mbs in fed for b in mbs if b.loss_mask.sum() == 0]
    want = [task.microbatch(0, i, cfg.train.micro_batch_size, split="eval") for i in range(n)]
    assert len(counted) == n and len(padding) == len(fed) * len(fed[0]) - n
    assert sorted(b.tokens.tolist() for b in counted) == sorted(b.tokens.tolist() for b in want)
    for b in padding:
        assert b.tokens.shape == want[0].tokens.shape and not torch.any(b.loss_mask)


def test_bad_assignments_are_refused():
    with pytest.raises(ValueError):
        lm.eval_assignment(4, 2, 2)
