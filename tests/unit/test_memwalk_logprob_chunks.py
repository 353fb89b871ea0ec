"""The planner's logits and log-prob working set against the trainer's own log-prob code, measured.

The RL loss runs ``rl.logprobs`` chunk by chunk; ``logprob_chunk_tokens=0`` (and any chunk of at least the
micro-batch's tokens) runs the very same code on one chunk of the whole batch. The plan of those cases must
therefore be what the live-tensor tracker measures for one chunk -- the 16-bit logits, their 16-bit gradient
and two fp32 ``[T, V]`` buffers -- not an extra fp32 copy of the logits."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_logra.memory.activations import logit_bytes
from megatron_logra.memory.count import count_params
from megatron_logra.memory.measure import LiveTensorTracker
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.rl.losses import token_logprobs_and_entropy

T, V = 512, 4096


def _model() -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128,
                       vocab_size=V, seq_length=T, params_dtype="bfloat16")


def _measured_peak(chunk: int) -> int:
    """Peak live bytes of the 16-bit logits plus what the log-prob forward and backward allocate."""
    torch.manual_seed(0)
    logits = torch.randn(T, V, dtype=torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, V, (T,))
    gc.collect()
    tracker = LiveTensorTracker()
    with tracker:
        base = tracker.current
        logp, entropy = token_logprobs_and_entropy(logits, labels, 1.0, None, chunk)
        (logp.sum() + entropy.sum()).backward()
    return tracker.peak - base + logits.numel() * logits.element_size()


@pytest.mark.parametrize("chunk", [0, T, 4 * T, T // 2])
def test_logit_plan_matches_measured_log_prob_peak(chunk):
    model = _model()
    counts = count_params(model)
    assert counts.padded_vocab == V
    planned = sum(logit_bytes(model, counts, tp=1, micro_batch=1, seq_len=T, chunk_tokens=chunk))
    measured = _measured_peak(chunk)
    # the measurement adds only a few [T] vectors (max, log-sum-exp, entropy, stats) to the [T, V] buffers
    assert measured <= planned * 1.01 and planned <= measured * 1.01, (chunk, planned, measured)


def test_one_chunk_of_everything_is_planned_like_chunk_zero():
    """0, exactly T and more than T tokens per chunk run one identical chunk: one identical plan, and never
    more than a chunk of T - 1 tokens plus one fp32 row pair (independent closed form: 2·B·T·V + 8·c·V)."""
    model = _model()
    counts = count_params(model)
    plans = {c: logit_bytes(model, counts, tp=1, micro_batch=1, seq_len=T, chunk_tokens=c) for c in (0, T, 3 * T)}
    assert len(set(plans.values())) == 1
    assert sum(plans[0]) == 2 * 2 * T * V + 8 * T * V
    below = sum(logit_bytes(model, counts, tp=1, micro_batch=1, seq_len=T, chunk_tokens=T - 1))
    assert sum(plans[0]) - below == 8 * V
