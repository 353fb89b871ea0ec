"""Turn rollouts (prompt ids, completion ids, log-probs, advantages) into trainer micro-batches.

A sequence ``prompt + completion`` becomes ``tokens = seq[:-1]``, ``labels = seq[1:]``; the
loss mask covers the positions whose label is a completion token. Per-token advantages and
rollout log-probs are aligned with the labels. Sequences are right-padded with ``pad_id``
to a common length (a multiple of 8, or of what FP8 and sequence parallelism need; at most
``max_length``), so every micro-batch of a step
has the same shape (pipeline schedules need that).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_logra.train.step import Batch

__all__ = ["pack_sequences", "split_microbatches"]


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


def split_microbatches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Consecutive row slices of ``batch`` (the last one may be smaller: fine for one pipeline stage; with
    more, ``rl.batch_layout.check_rl_batch_layout`` refuses the layouts that would make one)."""
    n = batch.tokens.shape[0]
    out = []
    for start in range(0, n, micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        out.append(Batch(
            tokens=batch.tokens[sl], labels=batch.labels[sl], loss_mask=batch.loss_mask[sl],
            position_ids=batch.position_ids[sl], extras={k: v[sl] for k, v in batch.extras.items()},
        ))
    return out
