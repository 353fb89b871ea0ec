"""Synthetic next-token tasks that a tiny GPT learns in seconds on a CPU.

``reverse``: ``[BOS] x_1 … x_n [SEP] x_n … x_1`` with random ``x_i``; the loss covers the
second half only, so the model must learn to attend back and reverse — chance level is
``log(data.num_symbols)`` (the ``x_i`` are drawn from the ``data.num_symbols`` symbols, not from the whole
vocabulary: 2.48 for ``lm-tiny``'s 12 symbols in a vocabulary of 32) and a working optimizer drives it
toward 0. ``copy`` repeats ``x_1 … x_n``.

Contracts
---------
* **Per-sequence data** — sequence ``j`` of step ``s`` (``j`` counts over the whole global batch)
  is a pure function of ``(data.seed, split, s, j)``. Micro-batch ``index`` of size ``b`` holds
  sequences ``index·b … index·b + b − 1``, so a step's global batch (sequences
  ``0 … global_batch_size − 1``) depends on the global batch size only: not on the micro-batch
  size, the number of micro-batches or the TP / PP / DP layout. As in Megatron-LM,
  ``train.micro_batch_size`` changes gradient accumulation, not the data.
* **Held-out split** — a content ``x_1 … x_n`` is eval-only iff a blake2b hash of it is
  ``0 mod`` :data:`EVAL_MODULUS` (about 1/16 of the ``num_symbols ** content_length`` contents).
  ``split="train"`` never produces an eval-only content and ``split="eval"`` only those, so the
  held-out loss is measured on sequences never trained on, for any seed, step or space size. A
  space too small to hold both kinds is refused, naming ``data.content_length`` /
  ``data.num_symbols``. Contents are drawn uniformly within their part.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.train.step import Batch

__all__ = ["EVAL_MODULUS", "SyntheticConfig", "SyntheticTask", "is_eval_content"]

BOS, SEP = 0, 1
NUM_SPECIAL = 2

EVAL_MODULUS = 16
"""Contents whose hash is 0 mod this are eval-only (held out from training)."""

ENUMERATE_LIMIT = 1 << 16
"""Content spaces up to this size are partitioned exactly (and checked to have both parts)."""

MAX_DRAWS = 8192
"""Candidate contents drawn per sequence before giving up (each is in the wanted part with p ≈ 1/16 or more)."""

_DRAW_BLOCK = 16
SEED_LIMIT = 1 << 63


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
    """Data seed, 0 <= seed < 2**63."""

    def __post_init__(self) -> None:
        if self.task not in ("reverse", "copy"):
            raise ValueError(f"data.task={self.task!r}: choose reverse or copy")
        if self.content_length < 1:
            raise ValueError(f"data.content_length={self.content_length} must be >= 1")
        if self.num_symbols < 2:
            raise ValueError(f"data.num_symbols={self.num_symbols} must be >= 2")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"data.seed={self.seed!r} must be an integer with 0 <= data.seed < 2**63")
        parts = _partition(self.num_symbols, self.content_length)
        if parts is not None and not (parts[0] and parts[1]):
            raise ValueError(
                f"data.num_symbols={self.num_symbols} ** data.content_length={self.content_length} = "
                f"{self.num_symbols ** self.content_length} contents leave "
                f"{'no held-out' if not parts[1] else 'no training'} sequence (1 in {EVAL_MODULUS} is held out by "
                f"its hash); raise data.content_length or data.num_symbols"
            )

    @property
    def seq_length(self) -> int:
        return 2 * self.content_length + 2


def is_eval_content(content: tuple[int, ...] | list[int]) -> bool:
    """Whether the content tokens ``x_1 … x_n`` (token ids) are held out for evaluation."""
    digest = hashlib.blake2b(struct.pack(f"<{len(content)}q", *content), digest_size=8, person=b"mlogra-lm-eval")
    return int.from_bytes(digest.digest(), "little") % EVAL_MODULUS == 0


def _content_of(value: int, num_symbols: int, length: int) -> tuple[int, ...]:
    """Content number ``value`` (base ``num_symbols``, first token most significant) as token ids."""
    digits = []
    for _ in range(length):
        value, digit = divmod(value, num_symbols)
        digits.append(NUM_SPECIAL + digit)
    return tuple(reversed(digits))


@functools.lru_cache(maxsize=16)
def _partition(num_symbols: int, length: int) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(train, eval)`` content numbers of a space of at most :data:`ENUMERATE_LIMIT` contents, else None."""
    size = num_symbols**length
    if size > ENUMERATE_LIMIT:
        return None
    train: list[int] = []
    held: list[int] = []
    for value in range(size):
        (held if is_eval_content(_content_of(value, num_symbols, length)) else train).append(value)
    return tuple(train), tuple(held)


def _sequence_seed(seed: int, split: str, step: int, sequence: int) -> int:
    digest = hashlib.blake2b(repr((seed, split, step, sequence)).encode(), digest_size=8, person=b"mlogra-lm-data")
    return int.from_bytes(digest.digest(), "little") >> 1  # < 2**63: torch.Generator.manual_seed's range


class SyntheticTask:
    """Deterministic micro-batches of the synthetic task (see the module contracts)."""

    def __init__(self, cfg: SyntheticConfig, vocab_size: int) -> None:
        if cfg.num_symbols + NUM_SPECIAL > vocab_size:
            raise ValueError(
                f"data.num_symbols={cfg.num_symbols} needs a vocabulary of at least {cfg.num_symbols + NUM_SPECIAL}; "
                f"model.vocab_size is {vocab_size}"
            )
        cfg.__post_init__()
        self.cfg = cfg
        self._parts = _partition(cfg.num_symbols, cfg.content_length)

    def content(self, step: int, sequence: int, *, split: str = "train") -> tuple[int, ...]:
        """Content tokens of sequence ``sequence`` (global over the step's batch) of ``step`` in ``split``."""
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: choose train or eval")
        cfg = self.cfg
        want_eval = split == "eval"
        gen = torch.Generator().manual_seed(_sequence_seed(cfg.seed, split, step, sequence))
        if self._parts is not None:
            part = self._parts[1 if want_eval else 0]
            pick = int(torch.randint(len(part), (1,), generator=gen))
            return _content_of(part[pick], cfg.num_symbols, cfg.content_length)
        for _ in range(MAX_DRAWS // _DRAW_BLOCK):
            block = torch.randint(NUM_SPECIAL, NUM_SPECIAL + cfg.num_symbols, (_DRAW_BLOCK, cfg.content_length),
                                  generator=gen).tolist()
            for row in block:
                if is_eval_content(row) == want_eval:
                    return tuple(row)
        raise RuntimeError(f"no {split} content in {MAX_DRAWS} draws (step {step}, sequence {sequence})")

    def microbatch(self, step: int, index: int, size: int, *, split: str = "train") -> Batch:
        """Micro-batch ``index`` (global over DP) of ``step``: sequences ``index·size … index·size + size − 1``,
        as ``[size, seq_length − 1]`` tokens / labels / loss mask / position ids."""
        n = self.cfg.content_length
        content = torch.tensor([self.content(step, index * size + r, split=split) for r in range(size)],
                               dtype=torch.long).reshape(size, n)
        answer = content.flip(1) if self.cfg.task == "reverse" else content
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
