"""Turn rollouts (prompt ids, completion ids, log-probs, advantages) into trainer micro-batches.

A sequence ``prompt + completion`` becomes ``tokens = seq[:-1]``, ``labels = seq[1:]``; the
loss mask covers the positions whose label is a completion token. Per-token advantages and
rollout log-probs are aligned with the labels. Sequences are right-padded with ``pad_id``
to a common length (a multiple of 8, or of what FP8 and sequence parallelism need; at most
``max_length``).

The step's batch then splits into micro-batches (:func:`plan_microbatches`): either consecutive rows of
``rl.micro_batch_size`` at the batch's length, so every micro-batch has one shape (what pipeline schedules
need), or, with a token budget (``rl.max_tokens_per_micro_batch``, slime's ``--use-dynamic-batch-size
--max-tokens-per-gpu``), rows grouped by length, each micro-batch cut to its own longest sequence, so a
step of a few long completions and many short ones does not pad every row to the longest. The loss is a sum
over tokens divided by the step's token count, so how the rows split changes only the order of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_logra.train.step import Batch

__all__ = ["MicroSlice", "pack_sequences", "plan_microbatches", "scatter_rows", "split_microbatches",
           "take_microbatch"]


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    rollout_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    finished: Sequence[bool],
    pad_id: int,
    max_length: int,
    multiple: int = 8,
) -> Batch:
    """One ``Batch`` holding every sequence (``[n, s]``); see the module docstring.

    ``s`` is the longest sequence rounded up to ``multiple`` (``models.te.sequence_multiple``: 8, or
    what FP8 and sequence parallelism need), at most ``max_length``, which must then be a multiple too."""
    if multiple < 1 or (multiple > 8 and max_length % multiple):
        raise ValueError(f"max_length={max_length} is not a multiple of {multiple}: FP8 / sequence parallelism need "
                         f"every sequence length to be one (set model.seq_length to a multiple of {multiple})")
    n = len(prompts)
    if not (len(completions) == len(rollout_logprobs) == len(advantages) == len(finished) == n):
        raise ValueError("prompts, completions, log-probs, advantages and finished flags must have equal lengths")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"sequences {empty[:4]} have an empty prompt: at least one token (e.g. BOS) must precede "
                         "the completion")
    lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, completions)]
    longest = max(lengths) if lengths else 1
    if longest > max_length:
        raise ValueError(f"a prompt+completion of {longest + 1} tokens exceeds the model context of {max_length + 1}")
    s = min(max_length, -(-longest // multiple) * multiple)
    tokens = torch.full((n, s), pad_id, dtype=torch.long)
    labels = torch.full((n, s), pad_id, dtype=torch.long)
    mask = torch.zeros((n, s), dtype=torch.float32)
    adv = torch.zeros((n, s), dtype=torch.float32)
    old_lp = torch.zeros((n, s), dtype=torch.float32)
    done = torch.zeros((n, s), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if len(c) != len(rollout_logprobs[i]):
            raise ValueError(f"sequence {i}: {len(c)} completion tokens but {len(rollout_logprobs[i])} log-probs")
        if not c:
            continue
        seq = torch.tensor(list(p) + list(c), dtype=torch.long)
        length = seq.numel() - 1
        tokens[i, :length] = seq[:-1]
        labels[i, :length] = seq[1:]
        start = len(p) - 1  # position whose label is the first completion token
        mask[i, start:length] = 1.0
        adv[i, start:length] = float(advantages[i])
        old_lp[i, start:length] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        done[i, start:length] = 1.0 if finished[i] else 0.0
    position_ids = torch.arange(s)[None].expand(n, -1).contiguous()
    return Batch(tokens=tokens, labels=labels, loss_mask=mask, position_ids=position_ids,
                 extras={"advantages": adv, "rollout_logprobs": old_lp, "finished": done})


@dataclass(frozen=True)
class MicroSlice:
    """One micro-batch of a step's batch: its rows (indices into the batch, in order) and its length (the
    first ``length`` positions of each row; every loss position of those rows lies within them)."""

    rows: tuple[int, ...]
    length: int


def sequence_ends(loss_mask_NS: torch.Tensor) -> list[int]:
    """Per row, one past its last loss position (0 for a row without one). Positions after it never reach the
    loss: attention is causal, so cutting them changes no logit the loss reads."""
    s = loss_mask_NS.shape[1]
    pos_S = torch.arange(1, s + 1, dtype=torch.long)
    return ((loss_mask_NS > 0).long() * pos_S).amax(dim=1).tolist() if s else [0] * loss_mask_NS.shape[0]


def plan_microbatches(batch: Batch, micro_batch_size: int, max_tokens: int = 0, multiple: int = 8) -> list[MicroSlice]:
    """How ``batch`` splits into micro-batches.

    ``max_tokens == 0``: consecutive rows of ``micro_batch_size`` at the batch's full length (the last one may
    be smaller: fine for one pipeline stage; with more, ``rl.batch_layout.check_rl_batch_layout`` refuses the
    layouts that would make one).

    ``max_tokens > 0`` (a token budget; ``micro_batch_size`` is not read): each row's length is its last loss
    position rounded up to ``multiple`` (at most the batch's length); rows are taken longest first (ties in row
    order) and each micro-batch holds as many as fit ``rows × its first row's length <= max_tokens``. A row
    longer than the budget is a micro-batch of its own. Deterministic: a pure function of the mask."""
    n, s = batch.tokens.shape
    if max_tokens < 0 or micro_batch_size < 1 or multiple < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 0 and micro_batch_size={micro_batch_size}, "
                         f"multiple={multiple} >= 1")
    if max_tokens == 0:
        return [MicroSlice(tuple(range(start, min(n, start + micro_batch_size))), s)
                for start in range(0, n, micro_batch_size)]
    lengths = [min(s, max(multiple, -(-end // multiple) * multiple)) for end in sequence_ends(batch.loss_mask)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    plan: list[MicroSlice] = []
    start = 0
    while start < n:
        length = lengths[order[start]]
        rows = max(1, max_tokens // length)
        chosen = order[start : start + rows]
        plan.append(MicroSlice(tuple(sorted(chosen)), length))
        start += len(chosen)
    return plan


def take_microbatch(batch: Batch, part: MicroSlice) -> Batch:
    """The rows and positions of ``part`` as a ``Batch`` (views where the rows are consecutive)."""
    rows = part.rows
    if rows and rows == tuple(range(rows[0], rows[0] + len(rows))):
        index = slice(rows[0], rows[0] + len(rows))
    else:
        index = torch.tensor(rows, dtype=torch.long)

    def cut(t: torch.Tensor) -> torch.Tensor:
        t = t[index]
        return t if t.shape[1] == part.length else t[:, : part.length]

    return Batch(tokens=cut(batch.tokens), labels=cut(batch.labels), loss_mask=cut(batch.loss_mask),
                 position_ids=cut(batch.position_ids), extras={k: cut(v) for k, v in batch.extras.items()})


def scatter_rows(parts: Sequence[torch.Tensor], plan: Sequence[MicroSlice], shape: tuple[int, int]) -> torch.Tensor:
    """Per-micro-batch ``[rows, length]`` tensors (in ``plan``'s order) put back at their rows and first
    positions of a zero ``shape`` tensor: the inverse of :func:`take_microbatch` for per-token values."""
    if len(parts) != len(plan):
        raise ValueError(f"{len(parts)} micro-batch results for a plan of {len(plan)} micro-batches")
    out = parts[0].new_zeros(shape) if parts else torch.zeros(shape)
    for part, piece in zip(plan, parts):
        if tuple(piece.shape) != (len(part.rows), part.length):
            raise ValueError(f"a micro-batch result of shape {tuple(piece.shape)} for "
                             f"{len(part.rows)} rows of {part.length} positions")
        out[torch.tensor(part.rows, dtype=torch.long), : part.length] = piece
    return out


def split_microbatches(batch: Batch, micro_batch_size: int, max_tokens: int = 0, multiple: int = 8) -> list[Batch]:
    """``batch`` as the micro-batches of :func:`plan_microbatches`."""
    return [take_microbatch(batch, part) for part in plan_microbatches(batch, micro_batch_size, max_tokens, multiple)]
