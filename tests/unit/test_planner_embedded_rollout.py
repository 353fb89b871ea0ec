"""An embedded rollout engine's KV cache and sampling state: planned beside the persistent state (the rollout
peak), measured on a real ``EmbeddedEngine.generate`` with ``LiveTensorTracker``, and mapped from a run config
by the preflight."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.memory.measure import LiveTensorTracker
from megatron_logra.memory.planner import embedded_kv_cache_bytes, plan
from megatron_logra.memory.preflight import embedded_rollout_sequences, run_plan_config
from megatron_logra.memory.units import GiB
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.config import parse_args_to_config

SEQUENCES, PROMPT, SEQ = 16, 8, 64


def _generate_peak(model: ModelConfig, top_p: float) -> int:
    """Live tensor bytes above the start while one ``generate()`` fills ``SEQ`` positions of every sequence."""
    from megatron_logra.rollout.embedded import EmbeddedEngine
    from megatron_logra.rollout.engine import SamplingParams

    engine = EmbeddedEngine(model, dtype=model.torch_dtype)
    prompts = [[1 + (i + j) % 50 for j in range(PROMPT)] for i in range(SEQUENCES)]
    params = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=SEQ - PROMPT + 1, stop_token_ids=[], seed=0)
    with LiveTensorTracker() as tracker:
        start = tracker.current
        engine.generate(prompts, params)
    return tracker.peak - start


@pytest.mark.parametrize("query_groups, vocab, top_p", [(None, 64, 1.0), (2, 64, 1.0), (None, 4000, 0.9),
                                                        (2, 4000, 0.9), (None, 4000, 1.0)])
def test_the_planned_rollout_peak_bounds_a_real_generate(one_thread, query_groups, vocab, top_p):
    model = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=query_groups,
                        ffn_hidden_size=128, vocab_size=vocab, seq_length=SEQ, params_dtype="bfloat16")
    planned = embedded_kv_cache_bytes(model, SEQUENCES, SEQ)
    measured = _generate_peak(model, top_p)
    assert measured <= planned * 1.03, (measured, planned)
    if top_p < 1.0 or vocab == 64:  # the KV cache's growth or top-p sampling: what the plan takes
        assert measured >= 0.97 * planned, (measured, planned)
    else:  # plain sampling holds less than the top-p bound: (B + 12)·V instead of (B + 33)·V per sequence
        assert measured >= planned - (33 - 12) * SEQUENCES * vocab * 1.03, (measured, planned)


def test_the_rollout_peak_enters_the_total_and_the_preflight_maps_the_embedded_engine():
    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, vocab_size=1000,
                        seq_length=512, params_dtype="bfloat16")
    base, rollout = (plan(model, rank=8, seq_len=512, recompute="full", rollout_sequences=n,
                          gpu_memory_bytes=8 * GiB).worst for n in (0, 4096))
    kv = embedded_kv_cache_bytes(model, 4096, 512)
    assert (base.rollout_working, rollout.rollout_working) == (0, kv)
    assert rollout.rollout_peak == rollout.persistent + kv > rollout.trainer_peak
    assert rollout.total == rollout.rollout_peak + rollout.engine + rollout.overhead
    # the preflight: a training step's prompts x group size per DP rank, or an evaluation's, whichever is larger
    cfg = parse_args_to_config("tiny", ["rl.rollout.engine=embedded", "rl.prompts_per_step=8", "rl.group_size=4",
                                        "task.num_eval=10", "rl.rollout.eval_samples=2", "rl.rollout.eval_temperature=1.0",
                                        "rl.eval_interval=5"])
    assert embedded_rollout_sequences(cfg, 2) == 16 and embedded_rollout_sequences(cfg, 1) == 32
    cfg_eval = parse_args_to_config("tiny", ["rl.rollout.engine=embedded", "rl.prompts_per_step=2",
                                             "rl.group_size=2", "task.num_eval=10", "rl.rollout.eval_samples=3",
                                             "rl.rollout.eval_temperature=1.0",
                                             "rl.eval_interval=5"])
    assert embedded_rollout_sequences(cfg_eval, 1) == 30
    pcfg = run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB)
    assert pcfg.rollout_sequences == 32
    assert plan(cfg.model, pcfg).worst.rollout_working == \
        embedded_kv_cache_bytes(cfg.model, 32, cfg.model.seq_length)
    sglang = parse_args_to_config("tiny", ["rl.rollout.engine=sglang"])
    assert embedded_rollout_sequences(sglang, 1) == 0  # SGLang's KV cache is inside its mem_fraction_static
