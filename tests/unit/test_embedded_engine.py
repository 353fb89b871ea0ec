"""EmbeddedEngine (``megatron_logra.rollout.embedded``) with weights taken from a megatron-core GPT.

References are computed from the megatron model itself (full forwards, no cache, no padding),
so they are independent of the engine's padding, caching, position ids and sampling code.

Tolerances: engine (transformers, KV cache, left padding) and megatron logits agree to
≈1e-6 absolute at logit scale ≈3 (see test_hf_mapping: bound 1e-5 relative). A log-prob
``z_t/T - logsumexp(z/T)`` then differs by at most 2·max|Δz|/T ≈ 1e-5 at T = 0.7, so log-probs
are compared with atol 5e-5; greedy tokens are compared exactly after asserting that every
reference step has a top-2 logit gap > 1e-3 (far above the 1e-5 disagreement, so no tie can flip).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

# Import before initialize_parallel: megatron_logra.cpu_shim's torch.cuda.Stream patch breaks late transformers imports.
from megatron_logra.rollout.embedded import EmbeddedEngine
from megatron_logra.models.gpt import ModelConfig, build_gpt
from megatron_logra.models.hf import megatron_to_hf
from megatron_logra.models.layout import gather_full_state
from megatron_logra.rollout import Rollout, RolloutEngine, SamplingParams

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=64, seq_length=64, init_std=0.1, layernorm_epsilon=1e-5)
PROMPTS = [[3, 17, 5], [9, 1, 44, 2, 8, 30, 12, 7, 61], [40], [22, 23, 24, 25, 26, 27]]
LOGP_ATOL = 5e-5
pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def megatron():
    """(groups, megatron model A, megatron model B) — two different policies."""
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = initialize_parallel(ParallelConfig())
        models = [build_gpt(CFG, groups, seed=s).eval() for s in (11, 12)]
    for seed, m in zip((11, 12), models):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in m.named_parameters():
                if p.dim() == 1:  # norms init to 1: perturb so a misplaced norm would show
                    p.add_(0.3 * torch.randn(p.shape, generator=gen))
    yield groups, models[0], models[1]
    destroy_parallel()


@pytest.fixture(scope="module")
def engine(megatron):
    groups, model_a, _ = megatron
    eng = EmbeddedEngine(CFG)
    eng.update_weights_full(megatron_to_hf(gather_full_state(model_a, groups.tp), CFG), version=1)
    return eng


@torch.no_grad()
def mg_logits(model, seq: list[int]) -> torch.Tensor:
    """Megatron logits ``[len(seq), V]`` of one unpadded sequence (full forward, no cache)."""
    tokens = torch.tensor([seq])
    return model(tokens, torch.arange(len(seq))[None], None)[0].float()


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        last = mg_logits(model, seq)[-1]
        top2 = last.topk(2).values
        assert top2[0] - top2[1] > 1e-3, "near-tie in the reference: pick another seed"
        seq.append(int(last.argmax()))
    return seq[len(prompt):]


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.weight_version == 1


def test_greedy_equals_stepwise_argmax_of_full_forwards(engine, megatron):
    _, model_a, _ = megatron
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len(out) == len(PROMPTS)
    for prompt, ro in zip(PROMPTS, out):
        assert ro.prompt_ids == prompt
        assert ro.completion_ids == greedy_reference(model_a, prompt, 8)
        assert ro.finished is False and ro.weight_version == 1  # cut by max_new_tokens
        # greedy log-probs are under softmax(z) (T = 1)
        logits = mg_logits(model_a, prompt + ro.completion_ids)
        ref = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1).gather(-1, torch.tensor(ro.completion_ids)[:, None])
        assert torch.allclose(torch.tensor(ro.logprobs), ref[:, 0], atol=LOGP_ATOL, rtol=0)


def test_left_padding_masks_and_positions(engine):
    """RoPE makes a constant position shift invisible in outputs, so check the batch layout directly."""
    ids, mask, pos = engine._left_pad([[7, 8, 9], [5]])
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos[mask.bool()].tolist() == [0, 1, 2, 0]  # every prompt starts at position 0


def test_eager_attention_matches_sdpa(engine, megatron):
    groups, model_a, _ = megatron
    eager = EmbeddedEngine(CFG, attn_implementation="eager")
    eager.update_weights_full(megatron_to_hf(gather_full_state(model_a, groups.tp), CFG), version=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)
    a, b = engine.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs)) < LOGP_ATOL
    with pytest.raises(ValueError, match="attn_implementation"):
        EmbeddedEngine(CFG, attn_implementation="flash")


def test_sampled_logprobs_match_full_forward(engine, megatron):
    _, model_a, _ = megatron
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, seed=5)
    out = engine.generate(PROMPTS, params)
    seqs = [ro.prompt_ids + ro.completion_ids for ro in out]
    scored = engine.logprobs_of(seqs, [len(p) for p in PROMPTS], temperature=0.7)
    for prompt, ro, lp in zip(PROMPTS, out, scored):
        assert len(ro.logprobs) == len(lp) == 10
        assert max(abs(a - b) for a, b in zip(ro.logprobs, lp)) < LOGP_ATOL
        # independent: megatron log_softmax(z / T), untruncated by top-p
        logits = mg_logits(model_a, prompt + ro.completion_ids)[len(prompt) - 1: -1]
        ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(ro.completion_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(ro.logprobs), ref, atol=LOGP_ATOL, rtol=0)


def test_stop_tokens_end_sequences_and_are_included(engine, megatron):
    _, model_a, _ = megatron
    full = [greedy_reference(model_a, p, 10) for p in PROMPTS]
    stop = full[0][3]  # a token greedy decoding of prompt 0 emits
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop]))
    hits = 0
    for ref, ro in zip(full, out):
        if stop in ref:
            cut = ref.index(stop) + 1
            assert ro.completion_ids == ref[:cut] and ro.completion_ids[-1] == stop and ro.finished is True
            assert len(ro.logprobs) == cut
            hits += 1
        else:
            assert ro.completion_ids == ref and ro.finished is False
    assert hits >= 1 and len(out[0].completion_ids) <= 4


def test_tiny_top_p_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    nucleus = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=3))
    for g, n in zip(greedy, nucleus):
        assert n.completion_ids == g.completion_ids
        assert max(abs(a - b) for a, b in zip(n.logprobs, g.logprobs)) < 1e-6  # both softmax(z) at T = 1


def test_seed_determinism(engine):
    p = dict(temperature=1.0, max_new_tokens=16)
    a = engine.generate(PROMPTS, SamplingParams(seed=1, **p))
    b = engine.generate(PROMPTS, SamplingParams(seed=1, **p))
    c = engine.generate(PROMPTS, SamplingParams(seed=2, **p))
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.completion_ids for r in a] != [r.completion_ids for r in c]


def _chi2_threshold(dof: int, z: float = 3.09) -> float:
    """Wilson–Hilferty upper quantile of χ²(dof); z = 3.09 is the standard-normal 0.999 quantile."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson χ² with bins of expected count < 5 merged into one; returns (statistic, dof)."""
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def test_first_token_frequencies_match_softmax(engine, megatron):
    """N draws of the first token vs p = softmax(z) of the megatron model (full vocabulary, T = 1).

    With p correct, Pearson's statistic is ≈ χ²(dof); we reject above its 0.999 quantile (a correct
    sampler fails with probability 1e-3 over seeds; the seed is fixed, so the test is deterministic).
    Power check: the same counts must be rejected against softmax(z / 1.5), a temperature off by 50%.
    The top-p run checks that no token outside the nucleus is drawn and the nucleus is renormalised.
    """
    _, model_a, _ = megatron
    prompt, n = [5, 9, 13, 2], 3000
    z = mg_logits(model_a, prompt)[-1].double()
    probs = torch.softmax(z, dim=-1)
    out = engine.generate([prompt] * n, SamplingParams(temperature=1.0, max_new_tokens=1, seed=4))
    counts = torch.bincount(torch.tensor([r.completion_ids[0] for r in out]), minlength=probs.numel())
    stat, dof = _chi2(counts, probs, n)
    assert dof >= 10  # the distribution is spread enough for a meaningful test
    assert stat < _chi2_threshold(dof), (stat, dof)
    wrong_stat, wrong_dof = _chi2(counts, torch.softmax(z / 1.5, dim=-1), n)
    assert wrong_stat > _chi2_threshold(wrong_dof)

    top_p = 0.5
    order = torch.argsort(probs, descending=True, stable=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    nucleus = order[before < top_p]
    q = torch.zeros_like(probs)
    q[nucleus] = probs[nucleus] / probs[nucleus].sum()
    out = engine.generate([prompt] * n, SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=1, seed=6))
    counts = torch.bincount(torch.tensor([r.completion_ids[0] for r in out]), minlength=probs.numel())
    assert int(counts[q == 0].sum()) == 0
    stat, dof = _chi2(counts, q, n)
    assert dof >= 1 and stat < _chi2_threshold(dof), (stat, dof)
    # reported log-probs are of the untruncated softmax
    lp = torch.tensor([r.logprobs[0] for r in out[:50]])
    ref = torch.log(probs)[torch.tensor([r.completion_ids[0] for r in out[:50]])].float()
    assert torch.allclose(lp, ref, atol=LOGP_ATOL, rtol=0)


def test_weight_versions_and_refit(megatron):
    groups, model_a, model_b = megatron
    eng = EmbeddedEngine(CFG)
    assert eng.weight_version == 0
    state_a = megatron_to_hf(gather_full_state(model_a, groups.tp), CFG)
    state_b = megatron_to_hf(gather_full_state(model_b, groups.tp), CFG)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)

    eng.update_weights_full(state_a, version=3)
    out_a = eng.generate(PROMPTS, greedy)
    assert eng.weight_version == 3 and all(r.weight_version == 3 for r in out_a)
    eng.update_weights_full(state_b, version=4)
    out_b = eng.generate(PROMPTS, greedy)
    assert eng.weight_version == 4 and all(r.weight_version == 4 for r in out_b)
    assert [r.completion_ids for r in out_a] != [r.completion_ids for r in out_b]
    assert out_b[1].completion_ids == greedy_reference(model_b, PROMPTS[1], 6)

    with pytest.raises(ValueError, match="version=-1"):
        eng.update_weights_full(state_a, version=-1)
    with pytest.raises(ValueError, match="version=True"):
        eng.update_weights_full(state_a, version=True)
    bad_name = dict(state_a, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ValueError, match=r"unknown names \['model\.layers\.9\.mlp\.up_proj\.weight'\]"):
        eng.update_weights_full(bad_name, version=5)
    with pytest.raises(ValueError, match=r"missing names \['model\.norm\.weight'\]"):
        eng.update_weights_full({k: v for k, v in state_a.items() if k != "model.norm.weight"}, version=5)
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        eng.update_weights_full(dict(state_a, **{"model.embed_tokens.weight": torch.zeros(65, 64)}), version=5)
    assert eng.weight_version == 4  # failed updates change nothing
    assert [r.completion_ids for r in eng.generate(PROMPTS, greedy)] == [r.completion_ids for r in out_b]
    # a reload may go back (a delta-directory consumer whose trainer resumed from an earlier checkpoint)
    eng.update_weights_full(state_a, version=3)
    back = eng.generate(PROMPTS, greedy)
    assert eng.weight_version == 3 and [r.completion_ids for r in back] == [r.completion_ids for r in out_a]


def test_streamed_refit_loads_pairs_and_marks_a_broken_stream_unknown(megatron):
    """A refit from a stream of (name, tensor) pairs (the trainer never holds the whole model):
    the stream is always consumed to its end, and a bad tensor part-way leaves version -1."""
    groups, model_a, model_b = megatron
    eng = EmbeddedEngine(CFG)
    state_a = megatron_to_hf(gather_full_state(model_a, groups.tp), CFG)
    state_b = megatron_to_hf(gather_full_state(model_b, groups.tp), CFG)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    eng.update_weights_full(state_a, version=1)
    want_a = [r.completion_ids for r in eng.generate(PROMPTS, greedy)]

    eng.update_weights_full(iter(sorted(state_b.items())), version=2)
    assert eng.weight_version == 2
    assert [r.completion_ids for r in eng.generate(PROMPTS, greedy)][1] == greedy_reference(model_b, PROMPTS[1], 6)
    for name, p in eng.model.named_parameters():
        assert torch.equal(p.detach(), state_b[name]), name

    pulled = []

    def broken():
        for i, (name, t) in enumerate(sorted(state_a.items())):
            pulled.append(name)
            yield (name, t) if i != 3 else (name, t[:-1])  # the fourth tensor has the wrong shape

    with pytest.raises(ValueError, match=r"shape .* weight_version = -1"):
        eng.update_weights_full(broken(), version=3)
    assert len(pulled) == len(state_a)  # consumed to the end
    assert eng.weight_version == -1
    with pytest.raises(ValueError, match="repeated"):
        eng.update_weights_full(iter([*state_a.items(), *list(state_a.items())[:1]]), version=4)
    eng.update_weights_full(iter(state_a.items()), version=4)  # a clean refit restores a known version
    assert eng.weight_version == 4 and [r.completion_ids for r in eng.generate(PROMPTS, greedy)] == want_a

    with pytest.raises(ValueError, match=r"missing names \['model\.norm\.weight'\]"):
        eng.update_weights_full(((k, v) for k, v in state_b.items() if k != "model.norm.weight"), version=5)
    assert eng.weight_version == -1


def test_too_long_prompt_raises(engine):
    # the last sampled token is never fed back: P + 8 - 1 <= 64 positions, so P <= 57 (rl.loop's bound too)
    ok = [1] * (CFG.seq_length - 8 + 1)
    engine.generate([ok], SamplingParams(temperature=0.0, max_new_tokens=8))
    with pytest.raises(ValueError, match=r"prompt 1 has 58 tokens.*64.*8.*57"):
        engine.generate([[1, 2], [1] * 58], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate([[64]], SamplingParams())  # outside the vocabulary


def test_generation_at_the_longest_prompt_matches_full_forwards(engine, megatron):
    """A prompt of seq_length + 1 - N tokens (the most rl.loop accepts) runs the model on seq_length
    positions; its greedy tokens and log-probs equal megatron's full forwards, and logprobs_of scores
    the whole seq_length + 1 token rollout."""
    _, model_a, _ = megatron
    steps = 8
    prompt = [(7 * i + 3) % CFG.vocab_size for i in range(CFG.seq_length + 1 - steps)]
    short = PROMPTS[1]  # batched with a short prompt: left padding at full width
    out = engine.generate([prompt, short], SamplingParams(temperature=0.0, max_new_tokens=steps))
    ro = out[0]
    assert ro.completion_ids == greedy_reference(model_a, prompt, steps)
    assert out[1].completion_ids == greedy_reference(model_a, short, steps)
    seq = prompt + ro.completion_ids
    assert len(seq) == CFG.seq_length + 1
    logits = mg_logits(model_a, seq[:-1])[len(prompt) - 1:]  # seq_length positions, as the trainer runs them
    ref = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ro.completion_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(ro.logprobs), ref, atol=LOGP_ATOL, rtol=0)
    scored = engine.logprobs_of([seq, short + out[1].completion_ids], [len(prompt), len(short)], temperature=0.0)
    assert torch.allclose(torch.tensor(scored[0]), ref, atol=LOGP_ATOL, rtol=0)
    assert max(abs(a - b) for a, b in zip(scored[1], out[1].logprobs)) < LOGP_ATOL
    with pytest.raises(ValueError, match=r"sequence 0 has 66 tokens"):
        engine.logprobs_of([seq + [1]], [len(prompt)])
    assert engine.logprobs_of([[5], [5, 6]], [1, 1], temperature=1.0)[0] == []


@pytest.mark.parametrize(
    "kw, field",
    [(dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
     (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
     (dict(seed=-1), "seed"), (dict(temperature=float("nan")), "temperature")],
)
def test_sampling_params_validation(kw, field):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingParams(**kw)


def test_rollout_validation():
    Rollout([1], [2, 3], [-0.1, -0.2], True, 0)
    with pytest.raises(ValueError, match="rollout.logprobs"):
        Rollout([1], [2, 3], [-0.1], True, 0)
