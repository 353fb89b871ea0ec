"""Synthetic next-token tasks that a tiny GPT learns in seconds on a CPU.

``reverse``: ``[BOS] x_1 … x_n [SEP] x_n … x_1`` with random ``x_i``; the loss covers the
second half only, so the model must learn to attend back and reverse — chance level is
``log(vocab)`` and a working optimizer drives it toward 0.

Batches depend only on ``(seed, step, micro-batch, data-parallel rank)``, so any parallel
layout sees the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.train.step import Batch

__all__ = ["SyntheticConfig", "SyntheticTask"]

BOS, SEP = 0, 1
NUM_SPECIAL = 2


@dataclass
class SyntheticConfig:
    """Synthetic next-token task."""

    task: str = "reverse"
    """reverse (reverse the random prefix after a separator) or copy."""
    content_length: int = 8
    """Random tokens before the separator; sequence length = 2 × content_length + 2."""
    num_symbols: int = 16
    """Distinct content symbols (≤ vocab_size − 2)."""
    seed: int = 1234
    """Data seed."""

    def __post_init__(self) -> None:
        if self.task not in ("reverse", "copy"):
            raise ValueError(f"data.task={self.task!r}: choose reverse or copy")
        if self.content_length < 1:
            raise ValueError(f"data.content_length={self.content_length} must be >= 1")
        if self.num_symbols < 2:
            raise ValueError(f"data.num_symbols={self.num_symbols} must be >= 2")

    @property
    def seq_length(self) -> int:
        return 2 * self.content_length + 2


class SyntheticTask:
    """Deterministic micro-batches of the synthetic task."""

    def __init__(self, cfg: SyntheticConfig, vocab_size: int) -> None:
        if cfg.num_symbols + NUM_SPECIAL > vocab_size:
            raise ValueError(
                f"data.num_symbols={cfg.num_symbols} needs a vocabulary of at least {cfg.num_symbols + NUM_SPECIAL}; "
                f"model.vocab_size is {vocab_size}"
            )
        self.cfg = cfg

    def microbatch(self, step: int, index: int, size: int, *, split: str = "train") -> Batch:
        """Micro-batch ``index`` (global over DP) of ``step``: ``[size, seq_length]``."""
        cfg = self.cfg
        salt = 0 if split == "train" else 1 << 40
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + salt + step * 10_007 + index)
        n = cfg.content_length
        content = torch.randint(NUM_SPECIAL, NUM_SPECIAL + cfg.num_symbols, (size, n), generator=gen)
        answer = content.flip(1) if cfg.task == "reverse" else content
        seq = torch.cat(
            [torch.full((size, 1), BOS), content, torch.full((size, 1), SEP), answer], dim=1
        )  # [b, 2n + 2]
        tokens = seq[:, :-1]
        labels = seq[:, 1:]
        loss_mask = torch.zeros_like(labels, dtype=torch.float32)
        loss_mask[:, n + 1 :] = 1.0  # predictions of the n answer tokens (after SEP)
        position_ids = torch.arange(tokens.shape[1])[None].expand(size, -1).contiguous()
        return Batch(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)

    def accuracy_inputs(self) -> int:
        """Number of answer tokens per sequence."""
        return self.cfg.content_length
