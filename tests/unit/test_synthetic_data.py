"""The LM job's synthetic data: a step's global batch depends on the global batch only (not on the
micro-batch size), the held-out sequences are disjoint from the training ones by construction, and
bad data settings are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.config import lm_tiny
from megatron_logra.data.synthetic import SyntheticConfig, SyntheticTask


def _global_batch(task: SyntheticTask, step: int, global_batch: int, micro: int, *, split: str = "train") -> torch.Tensor:
    return torch.cat([task.microbatch(step, i, micro, split=split).tokens for i in range(global_batch // micro)])


def _contents(task: SyntheticTask, step: int, count: int, *, split: str = "train") -> list[tuple[int, ...]]:
    n = task.cfg.content_length
    return [tuple(row) for row in task.microbatch(step, 0, count, split=split).tokens[:, 1 : n + 1].tolist()]


@pytest.mark.parametrize("micro", [1, 2, 4, 8, 16, 32])
def test_the_global_batch_does_not_depend_on_the_micro_batch_size(micro):
    cfg = lm_tiny()
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    for step in (1, 2, 77):
        want = task.microbatch(step, 0, 32).tokens  # one micro-batch holding the whole global batch
        assert torch.equal(_global_batch(task, step, 32, micro), want)
    assert torch.equal(_global_batch(task, 0, 64, micro, split="eval"), task.microbatch(0, 0, 64, split="eval").tokens)


def test_steps_seeds_and_splits_give_other_sequences_and_the_task_is_right():
    cfg = lm_tiny()
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    a, b = task.microbatch(1, 0, 32), task.microbatch(2, 0, 32)
    assert not torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, task.microbatch(1, 0, 32, split="eval").tokens)
    other = SyntheticTask(SyntheticConfig(task="reverse", content_length=6, num_symbols=12, seed=7), cfg.model.vocab_size)
    assert not torch.equal(a.tokens, other.microbatch(1, 0, 32).tokens)
    n = cfg.data.content_length
    assert torch.equal(a.labels[:, n + 1 :], a.tokens[:, 1 : n + 1].flip(1)) and a.loss_mask.sum() == 32 * n
    assert torch.equal(a.tokens, SyntheticTask(cfg.data, cfg.model.vocab_size).microbatch(1, 0, 32).tokens)


@pytest.mark.parametrize("content_length, num_symbols", [(6, 12), (3, 12), (4, 8), (3, 4), (2, 16)])
def test_held_out_sequences_are_never_trained_on(content_length, num_symbols):
    data = SyntheticConfig(task="copy", content_length=content_length, num_symbols=num_symbols)
    task = SyntheticTask(data, num_symbols + 2)
    train = {c for step in range(1, 201) for c in _contents(task, step, 32)}
    held = set(_contents(task, 0, 64, split="eval"))
    assert train and held and not train & held

    from megatron_logra.data.synthetic import EVAL_MODULUS, is_eval_content

    assert held == {task.content(0, j, split="eval") for j in range(64)}
    assert not any(is_eval_content(c) for c in train) and all(is_eval_content(c) for c in held)
    space = num_symbols**content_length
    if space <= 4096:  # small spaces: the train stream covers its whole part
        assert len(train) > 0.8 * space * (1 - 1 / EVAL_MODULUS)


@pytest.mark.parametrize("overrides, field", [
    (dict(content_length=1, num_symbols=2), "data.content_length"),
    (dict(content_length=2, num_symbols=3), "data.num_symbols"),
    (dict(seed=10**14 * 10**6), "data.seed"),
    (dict(seed=-1), "data.seed"),
    (dict(seed=1.5), "data.seed"),
])
def test_bad_data_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SyntheticConfig(**overrides)


def test_a_large_seed_works():
    task = SyntheticTask(SyntheticConfig(seed=10**14, content_length=6, num_symbols=12), 32)
    assert task.microbatch(1, 0, 4).tokens.shape == (4, 13)
