"""The LM job's held-out loss is measured on eval sequences ``0 .. train.eval_sequences - 1`` whatever
``train.micro_batch_size``: checked against a float64 cross-entropy of exactly those sequences computed here
from the model's own logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_logra.train.lm_eval as lm_eval
from megatron_logra.config import lm_tiny
from megatron_logra.data.synthetic import SyntheticTask


@pytest.fixture(scope="module")
def lm_model(groups, one_thread):
    """The lm-tiny model (init std 0.3: per-token losses differ well beyond rounding) and its LoGRA optimizer."""
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import build_optimizer

    cfg = lm_tiny()
    cfg.model.init_std = 0.3
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed)
    return cfg, model, build_optimizer(model, cfg.optimizer, groups)


def reference_loss(model, task: SyntheticTask, count: int) -> float:
    """Mean float64 cross-entropy over the answer tokens of eval sequences 0 .. count - 1, one sequence at a time."""
    model.eval()
    total = tokens = 0.0
    with torch.no_grad():
        for j in range(count):
            b = task.microbatch(0, j, 1, split="eval")  # sequence j alone
            logits = model(b.tokens, b.position_ids, None).double()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.labels.reshape(-1), reduction="none")
            total += (ce * b.loss_mask.reshape(-1).double()).sum().item()
            tokens += b.loss_mask.sum().item()
    model.train()
    return total / tokens


def _config(cfg, micro_batch_size: int, eval_sequences: int):
    out = lm_tiny()
    out.model, out.optimizer = cfg.model, cfg.optimizer
    out.train.micro_batch_size = micro_batch_size
    out.train.eval_sequences = eval_sequences
    return out


@pytest.mark.parametrize("count", [64, 40])
def test_the_held_out_loss_does_not_depend_on_the_micro_batch_size(lm_model, groups, count):
    cfg, model, optimizer = lm_model
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    want = reference_loss(model, task, count)
    got = {mbs: lm_eval.evaluate(model, task, _config(cfg, mbs, count), groups, optimizer) for mbs in (8, 16, 32)}
    for mbs, loss in got.items():
        assert loss == pytest.approx(want, rel=2e-6), (mbs, got, want)
    # the eval sets of different sizes really differ (the check above can tell them apart)
    assert abs(reference_loss(model, task, 32) - want) > 1e-3


def test_the_default_evaluates_the_sequences_lm_tiny_evaluated_before(lm_model, groups):
    """lm-tiny used to evaluate 4 micro-batches of 16: sequences 0 .. 63, the default train.eval_sequences; a
    config saved with the deprecated train.eval_batches keeps its eval_batches × micro_batch_size sequences."""
    cfg, model, optimizer = lm_model
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    assert lm_tiny().train.eval_sequences == 64 and lm_tiny().train.eval_batches is None
    default = lm_eval.evaluate(model, task, _config(cfg, 16, lm_tiny().train.eval_sequences), groups, optimizer)
    legacy = _config(cfg, 16, 999)
    legacy.train.eval_batches = 4
    assert lm_eval.eval_sequence_count(legacy) == 64
    assert lm_eval.evaluate(model, task, legacy, groups, optimizer) == default


def test_a_bad_eval_size_names_the_field():
    from megatron_logra.config import parse_args_to_config

    with pytest.raises(ValueError, match=r"train\.eval_sequences=0 must be >= 1"):
        parse_args_to_config("lm-tiny", ["train.eval_sequences=0"])
    with pytest.raises(ValueError, match=r"train\.eval_batches=0 must be >= 1 or null"):
        parse_args_to_config("lm-tiny", ["train.eval_batches=0"])
