"""Per-token log-probs and entropy of vocabulary-parallel logits, in chunks of tokens.

For logits ``z`` ``[..., V/tp]`` (this TP rank's vocabulary shard, in the model's dtype), global
label ids and a temperature ``τ``, with ``y = z/τ`` and ``p = softmax(y)`` over the *whole*
vocabulary:

* ``logp = y[label] − logsumexp(y)``;
* ``entropy = −Σ_v p_v log p_v = logsumexp(y) − Σ_v p_v y_v``.

A dense implementation (``log_softmax(z.float() / τ)``, or megatron's
``vocab_parallel_cross_entropy`` on ``z.float() / τ``) materialises several fp32 ``[T, V/tp]``
tensors for the whole batch — the upcast, the scaled copy, the softmax saved for backward and
the fp32 gradient — which at 27B scale (V = 262144, T = 8k tokens per micro-batch) is several GB
per buffer. Here a custom autograd function works through ``chunk_tokens`` rows at a time:

* forward: per chunk, ``y = z.float()/τ − m`` (``m``: the row max, one all-reduce MAX for the
  whole batch, taken on the model-dtype logits) and ``e = exp(y)``; their per-row sums (sum-exp,
  the label's shifted logit from the rank that owns it, ``Σ e·y`` for the entropy) go into a
  ``[3, T]`` buffer that is summed over the TP group once after the last chunk. Two fp32
  ``[chunk, V/tp]`` buffers are alive at a time;
* saved for backward: the logits themselves (no copy), the labels and two fp32 ``[T]`` vectors
  (``logsumexp`` and entropy);
* backward: per chunk the softmax is recomputed from the saved ``logsumexp`` and
  ``∂/∂z_v = (g_logp·(1[v = label] − p_v) − g_H·p_v·(log p_v + H)) / τ`` is written into the
  gradient (model dtype, the only full-size tensor backward creates; it is what megatron's output
  layer consumes). No collective in backward: every TP rank owns the gradient of its columns.

Labels are global vocabulary ids in ``[0, V)`` (``V`` = ``V/tp · tp``, the padded vocabulary); any other
label (an ignore index such as ``-100``, a token id of a larger tokenizer) is a ``ValueError`` naming it,
checked by one min/max of the labels per call (one device-to-host copy, no collective). The rank whose
shard ``[rank·V/tp, (rank+1)·V/tp)`` holds a label contributes its logit, the others 0 (as megatron does). Padded
vocabulary columns arrive masked to a large negative logit (``models.gpt.mask_padded_vocab``);
``-inf`` logits are allowed too (their probability is 0 and they add nothing to the entropy).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from megatron_logra.parallel import group_rank, group_size

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK_TOKENS", "chunked_token_logprobs", "token_entropy", "chunked_logprobs_and_entropy"]

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk when none is given: 1024 rows x V/tp columns of fp32 per working buffer."""

_NEG = -1.0e30
"""Floor of shifted fp32 logits in the entropy terms, so that ``-inf`` logits give ``0·(-1e30) = 0``, not NaN."""


def _all_reduce(t: torch.Tensor, op, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _spans(n: int, chunk: int):
    step = n if chunk <= 0 else chunk
    for start in range(0, n, max(step, 1)):
        yield start, min(n, start + step)


def _local_labels(labels_t: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this shard, clamped into range; True where this rank's shard holds the label)."""
    local = labels_t - vocab_start
    owned = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), owned


def _check_label_range(labels_t: torch.Tensor, vocab: int) -> None:
    """``ValueError`` naming a label outside ``[0, vocab)`` (the smallest when one is negative, else the
    largest); one device-to-host copy of (min, max)."""
    if labels_t.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(labels_t)).tolist()
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"labels: label {bad} is outside [0, {vocab}), the (padded) vocabulary of the logits "
                         f"({vocab} ids); labels must be token ids of the model's vocabulary: replace ignored "
                         "positions (e.g. -100) by any valid id and give them zero weight in the loss")


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """(logp ``[T]``, entropy ``[T]``) of ``logits_tV`` ``[T, V/tp]``; see the module docstring."""

    @staticmethod
    def forward(ctx, logits_tV, labels_t, temperature, chunk, tp_group, want_logp, want_entropy):
        size = group_size(tp_group)
        local_vocab = logits_tV.shape[-1]
        vocab_start = group_rank(tp_group) * local_vocab
        n = logits_tV.shape[0]
        if want_logp:
            _check_label_range(labels_t, local_vocab * size)
        # the row max on the model-dtype logits (exact in any dtype; max(z)/τ = max(z/τ) for τ > 0)
        max_t = logits_tV.amax(dim=-1).float()
        _all_reduce(max_t, dist.ReduceOp.MAX, tp_group, size)
        max_t.div_(temperature)
        stats_3t = torch.zeros(3, n, dtype=torch.float32, device=logits_tV.device)
        if want_logp:
            local_idx, owned = _local_labels(labels_t, vocab_start, local_vocab)
        for a, b in _spans(n, chunk):
            y_cV = logits_tV[a:b].to(torch.float32, copy=True)
            y_cV.div_(temperature).sub_(max_t[a:b, None])
            e_cV = torch.exp(y_cV)
            stats_3t[0, a:b] = e_cV.sum(dim=-1)
            if want_logp:
                picked = y_cV.gather(1, local_idx[a:b, None])[:, 0]
                stats_3t[1, a:b] = torch.where(owned[a:b], picked, torch.zeros_like(picked))
            if want_entropy:
                stats_3t[2, a:b] = e_cV.mul_(y_cV.clamp_(min=_NEG)).sum(dim=-1)
            del y_cV, e_cV
        _all_reduce(stats_3t, dist.ReduceOp.SUM, tp_group, size)
        log_sum_t = torch.log(stats_3t[0])
        logp_t = stats_3t[1] - log_sum_t if want_logp else None
        entropy_t = log_sum_t - stats_3t[2] / stats_3t[0] if want_entropy else None
        lse_t = max_t + log_sum_t
        ctx.temperature, ctx.chunk, ctx.vocab_start = temperature, chunk, vocab_start
        ctx.want_logp, ctx.want_entropy = want_logp, want_entropy
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits_tV, labels_t if want_logp else None, lse_t, entropy_t)
        return logp_t, entropy_t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp_t, grad_entropy_t):
        logits_tV, labels_t, lse_t, entropy_t = ctx.saved_tensors
        use_logp = ctx.want_logp and grad_logp_t is not None
        use_ent = ctx.want_entropy and grad_entropy_t is not None
        if not ctx.needs_input_grad[0] or not (use_logp or use_ent):
            return (None,) * 7
        grad_tV = torch.empty_like(logits_tV)
        tau = ctx.temperature
        local_vocab = logits_tV.shape[-1]
        if use_logp:
            local_idx, owned = _local_labels(labels_t, ctx.vocab_start, local_vocab)
            g_logp_t = grad_logp_t.float()
        g_ent_t = grad_entropy_t.float() if use_ent else None
        for a, b in _spans(logits_tV.shape[0], ctx.chunk):
            logq_cV = logits_tV[a:b].to(torch.float32, copy=True)
            logq_cV.div_(tau).sub_(lse_t[a:b, None])  # log p
            p_cV = torch.exp(logq_cV)
            if use_ent:
                # g_H·p·(log p + H), then + g_logp·p: the negated gradient before the label term
                acc_cV = logq_cV.clamp_(min=_NEG).add_(entropy_t[a:b, None]).mul_(p_cV).mul_(g_ent_t[a:b, None])
                if use_logp:
                    acc_cV.addcmul_(p_cV, g_logp_t[a:b, None])
            else:
                acc_cV = p_cV.mul_(g_logp_t[a:b, None])
            del logq_cV, p_cV  # acc_cV is one of them: at most two fp32 chunk buffers are alive
            if use_logp:
                rows = torch.arange(b - a, device=acc_cV.device)
                acc_cV.index_put_((rows, local_idx[a:b]), -g_logp_t[a:b] * owned[a:b], accumulate=True)
            grad_tV[a:b].copy_(acc_cV.mul_(-1.0 / tau))
            del acc_cV
        return grad_tV, None, None, None, None, None, None


def _flatten(logits: torch.Tensor, labels: Optional[torch.Tensor]):
    if logits.dim() < 1:
        raise ValueError("logits need a vocabulary dimension")
    lead = logits.shape[:-1]
    if labels is not None and tuple(labels.shape) != tuple(lead):
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    logits_tV = logits.reshape(-1, logits.shape[-1])
    labels_t = labels.reshape(-1).long() if labels is not None else None
    return lead, logits_tV, labels_t


def _check(temperature: float, chunk_tokens: Optional[int]) -> int:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else int(chunk_tokens)
    if chunk < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 0 (0 = the whole batch in one chunk)")
    return chunk


def chunked_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, tp_group=None,
    chunk_tokens: Optional[int] = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log softmax(z/τ)[label], entropy of softmax(z/τ))``, each ``logits.shape[:-1]``, fp32,
    both differentiable w.r.t. ``logits`` (``[..., V/tp]``, this TP rank's vocabulary shard)."""
    chunk = _check(temperature, chunk_tokens)
    lead, logits_tV, labels_t = _flatten(logits, labels)
    logp_t, entropy_t = _ChunkedLogprobEntropy.apply(logits_tV, labels_t, float(temperature), chunk, tp_group,
                                                     True, True)
    return logp_t.view(lead), entropy_t.view(lead)


def chunked_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, tp_group=None,
    chunk_tokens: Optional[int] = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``log softmax(z/τ)[label]`` per position (fp32, ``labels.shape``), differentiable w.r.t.
    ``logits`` ``[..., V/tp]``; ``labels`` are global vocabulary ids; ``chunk_tokens`` rows are
    processed at a time (``0``: all at once)."""
    chunk = _check(temperature, chunk_tokens)
    lead, logits_tV, labels_t = _flatten(logits, labels)
    logp_t, _ = _ChunkedLogprobEntropy.apply(logits_tV, labels_t, float(temperature), chunk, tp_group, True, False)
    return logp_t.view(lead)


def token_entropy(
    logits: torch.Tensor, temperature: float = 1.0, tp_group=None, chunk_tokens: Optional[int] = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Entropy of ``softmax(z/τ)`` per position (fp32, ``logits.shape[:-1]``), differentiable,
    over vocabulary-parallel logits ``[..., V/tp]``, ``chunk_tokens`` rows at a time."""
    chunk = _check(temperature, chunk_tokens)
    lead, logits_tV, _ = _flatten(logits, None)
    _, entropy_t = _ChunkedLogprobEntropy.apply(logits_tV, None, float(temperature), chunk, tp_group, False, True)
    return entropy_t.view(lead)
