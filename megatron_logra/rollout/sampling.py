"""Token sampling for the embedded rollout engine (:func:`sample_next`): one draw per row from fp32 logits.

The log-prob it returns is the one the trainer recomputes (:mod:`megatron_logra.rollout.engine`:
``log_softmax(z / T)`` at the sampled token, before top-p truncation; ``softmax(z)`` when greedy), so
rollout and trainer log-probs describe the same distribution. Draws come only from the ``generator``
passed in (never the global RNG): the same logits, parameters and generator state give the same
tokens, which keeps rollouts reproducible from ``SamplingParams.seed``. Its top-p path is the
sampling peak the memory planner models (``memory.planner.embedded_kv_cache_bytes``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["sample_next"]


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` ``[B, V]`` (fp32).

    Returns ``(tokens [B] int64, logprobs [B] fp32)``: ``logprobs`` are of ``softmax(z / T)``
    before top-p truncation (``softmax(z)`` when ``T == 0``, which takes the argmax, lowest id on ties).
    Top-p keeps, in descending probability order (stable: lower id first on ties), every token whose
    preceding mass is ``< top_p``; the most likely token is therefore always kept.
    """
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
        probs = sorted_logp.exp()
        keep = (probs.cumsum(dim=-1) - probs) < top_p
        keep[:, 0] = True
        nucleus = torch.where(keep, probs, torch.zeros_like(probs))
        choice = torch.multinomial(nucleus, 1, generator=generator)
        tokens = order.gather(-1, choice)[:, 0]
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
