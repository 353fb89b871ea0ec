"""Work an RL step does once per distinct prompt, not once per sample: the embedded engine's prompt
forward (a GRPO group repeats its prompt ``rl.group_size`` times) and the tokenization of the prompts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# Import before anything initialises megatron's parallel state (see test_embedded_engine.py).
from megatron_logra.rollout.embedded import EmbeddedEngine
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.rollout import SamplingParams
import megatron_logra.rl.prompts as prompts

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=64, seq_length=64, init_std=0.1, layernorm_epsilon=1e-5)
A, B, C = [3, 17, 5], [9, 1, 44, 2, 8, 30, 12, 7, 61], [40]
PROMPTS = [A, B, A, C, B, A]  # repeats, not adjacent
NEW_TOKENS = 5


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(CFG, init_seed=3)


def _batch_sizes(engine, prompts, params):
    sizes = []
    handle = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        out = engine.generate(prompts, params)
    finally:
        handle.remove()
    return out, sizes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompt_forward_runs_once_per_distinct_prompt(engine, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=NEW_TOKENS, seed=7)
    out, sizes = _batch_sizes(engine, PROMPTS, params)
    # the prompt forward on the 3 distinct prompts, then one decode forward per further token on every row
    assert sizes == [3] + [len(PROMPTS)] * (NEW_TOKENS - 1)
    assert [r.prompt_ids for r in out] == PROMPTS
    # every row is scored by the policy: its sampled log-probs are those of a full forward of its sequence
    full = engine.logprobs_of([r.prompt_ids + r.completion_ids for r in out], [len(p) for p in PROMPTS],
                              temperature=temperature)
    for r, ref in zip(out, full):
        assert len(r.completion_ids) == NEW_TOKENS
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-5, rtol=0)
    if temperature == 0:  # the rows of one prompt share its logits and cache: identical greedy completions
        assert out[0].completion_ids == out[2].completion_ids == out[5].completion_ids
        assert out[0].logprobs == out[2].logprobs == out[5].logprobs
        assert out[1].completion_ids == out[4].completion_ids


def test_distinct_prompts_run_the_whole_batch(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=7)
    _, sizes = _batch_sizes(engine, [A, B, C], params)
    assert sizes == [3] * NEW_TOKENS


def test_prompt_batch_tokenizes_each_problem_once(monkeypatch):
    """The real tokenization (the tiny recipe's tokenizer and prompt template), spied on: once per problem,
    each problem's ids repeated ``repeat`` times."""
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.data.tokenizer import build_tokenizer

    cfg = parse_args_to_config("tiny", [])
    comps = SimpleNamespace(groups=SimpleNamespace(dp=None), cfg=cfg, tokenizer=build_tokenizer(cfg.tokenizer, []))
    calls = []
    real = prompts._prompt_ids

    def spy(c, text, *rest):  # rest: held_out, for the held-out evaluation's own room
        calls.append((text, real(c, text, *rest)))
        return calls[-1][1]

    monkeypatch.setattr(prompts, "_prompt_ids", spy)
    problems = [SimpleNamespace(prompt=p) for p in ("1 + 2 =", "3 + 45 =")]
    ids = prompts._prompt_batch(comps, problems, 4)
    assert [text for text, _ in calls] == ["1 + 2 =", "3 + 45 ="]
    first, second = (list(one) for _, one in calls)
    assert first != second and first and second
    assert ids == [first] * 4 + [second] * 4
    assert len({id(x) for x in ids}) == len(ids)  # each row its own list
