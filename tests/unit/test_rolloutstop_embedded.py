"""Stop tokens (``rl.rollout.stop_token_ids``) and stop strings (``rl.rollout.stop``) on the embedded engine with the
shipped warm-started ``tiny`` model and its word tokenizer.

The model answers ``... 2 - 7 =`` with tokens such as ``=`` (38), `` `` (9), ``-`` (22), digits and ``<eos>`` (2).
Sampling draws for every row at every step from one generator, so a run with more stops samples exactly the tokens
of the run without them up to where a row stops: each stopped rollout must be the baseline's cut after its stop,
with the baseline's log-probs, which must also be the trainer's recomputed ones for the kept tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_logra.rollout.engine import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

EOS, EQUALS, SPACE, MINUS = 2, 38, 9, 22
PROMPTS = [  # eight chain_sum prompts of the tiny task ("State the final answer ...: 2 - 7 =" and so on), templated
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 27, 9, 22, 9, 32, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 28, 9, 22, 9, 26, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 33, 9, 22, 9, 32, 9, 20, 9, 28, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 25, 9, 22, 9, 25, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 27, 9, 20, 9, 31, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 31, 9, 22, 9, 34, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 26, 9, 22, 9, 27, 9, 38, 5],
    [1, 145, 109, 142, 140, 129, 109, 143, 141, 144, 35, 9, 26, 9, 22, 9, 30, 9, 38, 5],
]
BEFORE = [  # the completions the engine sampled for PROMPTS (T = 1, seed 7, EOS only) before stop strings existed
    [38, 9, 22, 30, 2], [38, 9, 27, 2], [38, 9, 29, 2], [38, 9, 25, 2], [38, 9, 33, 2], [22, 28, 2], [22, 26, 2],
    [22, 29, 2],
]
BEFORE_FIRST_LOGPROBS = [-0.5230378, -0.5070533, -0.7016190, -0.2883314, -0.2974757, -0.9583083, -1.2239741]
TRAINER_ATOL = 1e-4  # engine (transformers) vs trainer (megatron) fp32 log-probs of the same weights


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 12, "stop_token_ids": [EOS], "seed": 7, **kw})


@pytest.fixture(scope="module")
def comps(tmp_path_factory, one_thread):
    """The tiny run's components, built with ``--rollout-stop-token-ids 9 --rollout-stop '= '``."""
    from megatron_logra.config import WARM_START_TINY, parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    if not (WARM_START_TINY / "model.safetensors").exists():
        pytest.fail(f"the shipped warm start {WARM_START_TINY} is missing")
    cfg = parse_args_to_config("tiny", [
        "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch_size=4", "task.num_eval=4",
        "rl.eval_interval=0", f"train.run_dir={tmp_path_factory.mktemp('rolloutstop') / 'run'}",
        "train.progress=false", "--rollout-stop-token-ids", str(SPACE), "--rollout-stop", "= ",
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, _, _ = build_components(cfg)
    yield built
    destroy_parallel()


@pytest.fixture(scope="module")
def baseline(comps):
    return comps.engine.generate(PROMPTS, params())


def trainer_logprobs(comps, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax(z / T) of a fresh trainer forward at the completion tokens (float64)."""
    seq = prompt + completion
    with torch.no_grad():
        logits = comps.model(torch.tensor([seq]), torch.arange(len(seq))[None], None)
    logp = torch.log_softmax(logits[0].double(), dim=-1)  # T = 1
    return torch.stack([logp[t - 1, seq[t]] for t in range(len(prompt), len(seq))])


def assert_cut_baseline(rollouts, baseline, cut_at) -> int:
    """Each rollout is its baseline rollout cut after ``cut_at(ids)`` tokens (None: not cut), bitwise, with the
    trainer's log-probs; returns how many were cut short."""
    cut = 0
    for r, b in zip(rollouts, baseline):
        n = cut_at(b.completion_ids)
        if n is None:
            assert (r.completion_ids, r.logprobs, r.finished) == (b.completion_ids, b.logprobs, b.finished)
            continue
        cut += n < len(b.completion_ids)
        assert r.completion_ids == b.completion_ids[:n] and r.logprobs == b.logprobs[:n] and r.finished
    return cut


def test_default_rollouts_are_as_before(comps, baseline):
    assert [r.completion_ids for r in baseline] == BEFORE
    assert all(r.finished for r in baseline)
    first = torch.tensor([r.logprobs[0] for r in baseline[:7]], dtype=torch.float64)
    torch.testing.assert_close(first, torch.tensor(BEFORE_FIRST_LOGPROBS, dtype=torch.float64), atol=1e-5, rtol=0)
    never = comps.engine.generate(PROMPTS, params(stop=["never said"]))  # the stop-string path, matching nothing
    assert [(r.completion_ids, r.logprobs, r.finished) for r in never] == \
        [(r.completion_ids, r.logprobs, r.finished) for r in baseline]


def test_the_run_stops_at_the_configured_token_too(comps):
    assert comps.cfg.rl.rollout.stop_token_ids == [SPACE] and comps.cfg.rl.rollout.stop == ["= "]
    assert comps.stop_token_ids() == [EOS, SPACE]  # the tokenizer's EOS and the extra id
    from megatron_logra.rl.prompts import _decode

    assert _decode(comps, [EQUALS, SPACE]) == "="  # the reward's text leaves a stop token out, as it does EOS


def test_an_extra_stop_token_ends_the_completion_with_its_logprob(comps, baseline):
    rollouts = comps.engine.generate(PROMPTS, params(stop_token_ids=comps.stop_token_ids()))
    cut = assert_cut_baseline(rollouts, baseline, lambda ids: ids.index(SPACE) + 1 if SPACE in ids else None)
    assert cut == 5  # "= <digit>" answers end at the space: [=, ' ']
    for r, prompt in zip(rollouts, PROMPTS):
        assert r.completion_ids[-1] in (SPACE, EOS)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64),
                                   trainer_logprobs(comps, prompt, r.completion_ids), atol=TRAINER_ATOL, rtol=0)


@pytest.mark.parametrize("stop, completes", [
    ("= ", lambda ids: next((j + 1 for j in range(1, len(ids)) if ids[j - 1:j + 1] == [EQUALS, SPACE]), None)),
    ("-", lambda ids: ids.index(MINUS) + 1 if MINUS in ids else None),
])
def test_a_stop_string_ends_the_completion_at_the_token_completing_it(comps, baseline, stop, completes,
                                                                      monkeypatch):
    from megatron_logra.rl.prompts import _decode

    monkeypatch.setattr(comps, "stop_ids", [EOS])  # the reward's text keeps the space (no stop token here)
    rollouts = comps.engine.generate(PROMPTS, params(stop=[stop]))
    assert assert_cut_baseline(rollouts, baseline, completes) >= 1
    for r, b, prompt in zip(rollouts, baseline, PROMPTS):
        text = _decode(comps, r.completion_ids)  # the text the reward scores
        if completes(b.completion_ids) is not None:
            assert text.endswith(stop) and stop not in text[:-1], text  # ends at the first occurrence
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64),
                                   trainer_logprobs(comps, prompt, r.completion_ids), atol=TRAINER_ATOL, rtol=0)
    both = comps.engine.generate(PROMPTS, params(stop=["= ", "-"]))  # the first one completed ends it
    assert [r.completion_ids for r in both] == [[EQUALS, SPACE]] * 5 + [[MINUS]] * 3


def test_stop_strings_need_the_engines_tokenizer(comps):
    engine, tokenizer = comps.engine, comps.engine.tokenizer
    engine.tokenizer = None
    try:
        with pytest.raises(ValueError, match=r"rl\.rollout\.stop.*tokenizer"):
            engine.generate(PROMPTS[:1], params(stop=["="]))
        assert engine.generate(PROMPTS[:1], params())[0].completion_ids == BEFORE[0]  # without stop strings: fine
    finally:
        engine.tokenizer = tokenizer


def test_training_and_held_out_rollouts_use_the_stops(comps, monkeypatch):
    from megatron_logra.rl.evaluation import evaluate_held_out
    from megatron_logra.rl.rollout_stage import _sample_round

    seen = []
    generate = comps.engine.generate

    def spy(prompts, p):
        seen.append(p)
        return generate(prompts, p)

    monkeypatch.setattr(comps.engine, "generate", spy)
    _sample_round(comps, 0, 0, 2, 0, None)
    evaluate_held_out(comps)
    assert len(seen) == 2
    for p in seen:
        assert p.stop == ["= "] and p.stop_token_ids == [EOS, SPACE]
    assert seen[1].temperature == comps.cfg.rl.rollout.eval_temperature  # the second was the evaluation's
