"""The RL loop's reported numbers against references computed here from the model itself.

* Held-out accuracy (``rl.loop.evaluate_accuracy``, behind ``eval_accuracy_before/after`` in
  summary.json, ``eval_accuracy`` in metrics.jsonl and ``megatron-logra eval``): every eval prompt is
  decoded greedily with argmax over full forwards of the trainer's megatron model (no engine, no KV
  cache), each completion is scored with reasoning-gym's own ``ChainSumDataset.score_answer``, and the
  accuracy must be exactly the fraction of correct completions.
* The measured KL of an update (``kl_actual`` of the metrics record): the exact mean
  ``KL(softmax(z_old/τ) ‖ softmax(z_new/τ))`` over the probe's positions, from forwards of the model
  just before the update is applied and just after it, at the rollout temperature τ.

The shipped warm start of the tiny recipe answers a few of the 200 eval problems right (7), so the
expected accuracy is neither 0 nor 1 (asserted). The rollout temperature is 0.7, so a KL taken at another
temperature would differ.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

TEMPERATURE = 0.7
PROBE_SEQUENCES = 3
PROBE_MAX_TOKENS = 5


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_thread):
    from megatron_logra.config import WARM_START_TINY, parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    if not (WARM_START_TINY / "model.safetensors").exists():
        pytest.fail(f"the shipped warm start {WARM_START_TINY} is missing")
    run = tmp_path_factory.mktemp("evalref_rl") / "run"
    cfg = parse_args_to_config("tiny", [
        "rl.steps=1", "rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=16", "task.num_eval=200",
        "rl.eval_interval=0", f"rl.rollout.temperature={TEMPERATURE}", f"kl.probe_sequences={PROBE_SEQUENCES}",
        f"kl.probe_max_tokens={PROBE_MAX_TOKENS}", f"train.run_dir={run}", "train.progress=false",
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    yield comps, state
    destroy_parallel()


def model_logits(model, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, V]`` logits of a plain forward in eval mode (every module's own mode restored after)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return model(tokens, position_ids, None)
    finally:
        for m, training in modes:
            m.training = training


def greedy_completions(comps, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy completions (argmax of full forwards, ids up to and including the first stop id, at most
    ``rl.rollout.max_new_tokens``) and the smallest top-1/top-2 logit gap met while decoding them."""
    stop = set(comps.stop_token_ids())
    limit = comps.cfg.rl.rollout.max_new_tokens
    out: list[list[int]] = [[] for _ in prompts]
    min_gap = math.inf
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    for length, rows in by_length.items():  # equal lengths batch without padding
        seqs = torch.tensor([prompts[i] for i in rows])
        done = [False] * len(rows)
        for _ in range(limit):
            logits = model_logits(comps.model, seqs, torch.arange(seqs.shape[1])[None].expand(len(rows), -1))
            last = logits[:, -1].double()
            top2 = last.topk(2, dim=-1).values
            nxt = last.argmax(dim=-1)
            for j, i in enumerate(rows):
                if not done[j]:
                    min_gap = min(min_gap, (top2[j, 0] - top2[j, 1]).item())
                    out[i].append(int(nxt[j]))
                    done[j] = int(nxt[j]) in stop
            if all(done):
                break
            seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    return out, min_gap


def completion_text(comps, ids: list[int]) -> str:
    stop = set(comps.stop_token_ids())
    return comps.tokenizer.decode([i for i in ids if i not in stop], skip_special_tokens=True)


def reference_eval(comps):
    """(problems, their greedy completion texts) from the trainer model, with a well-posed argmax."""
    from megatron_logra.rl.loop import rl_prompt_ids

    problems = comps.task.eval_problems()
    prompts = [rl_prompt_ids(comps.tokenizer, comps.cfg.rl, p.prompt) for p in problems]
    ids, min_gap = greedy_completions(comps, prompts)
    # the engine decodes the same weights in another implementation: a near tie could flip its argmax
    assert min_gap > 1e-4, f"an argmax is nearly tied (gap {min_gap:.2e}); the greedy reference is ill-posed"
    return problems, [completion_text(comps, c) for c in ids]


def gym_correct(dataset, problem, completion: str) -> bool:
    """reasoning-gym's verdict on ``completion`` (the dataset's own ``score_answer``; 1.0 is correct)."""
    assert "<answer>" not in completion  # the whole stripped completion is the answer
    entry = {"question": problem.prompt, "answer": problem.answer, "metadata": problem.metadata}
    return float(dataset.score_answer(answer=completion.strip(), entry=entry)) >= 1.0


def test_eval_accuracy_is_the_fraction_of_greedy_completions_reasoning_gym_scores_correct(built):
    import reasoning_gym

    from megatron_logra.rl.loop import evaluate_accuracy

    comps, _ = built
    assert comps.cfg.rl.rollout.eval_temperature == 0 and comps.cfg.rl.rollout.eval_samples == 1  # greedy
    assert comps.cfg.task.datasets == ["chain_sum"]
    problems, texts = reference_eval(comps)
    assert len(problems) == comps.cfg.task.num_eval == 200
    dataset = reasoning_gym.create_dataset("chain_sum", seed=0, size=1, **comps.cfg.task.dataset_kwargs["chain_sum"])
    correct = sum(gym_correct(dataset, p, t) for p, t in zip(problems, texts))
    assert 0 < correct < len(problems), f"{correct} of {len(problems)} correct: the check needs both kinds"
    assert evaluate_accuracy(comps) == correct / len(problems)


def test_eval_accuracy_counts_exactly_the_problems_a_scorer_accepts(built, monkeypatch):
    """A scorer that accepts every third problem gives k/n exactly, and it is shown each problem's
    greedy completion once."""
    from megatron_logra.rl.loop import evaluate_accuracy

    comps, _ = built
    problems, texts = reference_eval(comps)
    accepted = {p.prompt for p in problems[::3]}
    seen: dict[str, list[str]] = {}

    def score(problem, completion):
        seen.setdefault(problem.prompt, []).append(completion)
        ok = problem.prompt in accepted
        return (1.0 if ok else 0.0), ok

    monkeypatch.setattr(comps.task, "score", score)
    accuracy = evaluate_accuracy(comps)
    assert accuracy == len(accepted) / len(problems)
    assert 0 < len(accepted) < len(problems)
    assert seen == {p.prompt: [t] for p, t in zip(problems, texts)}


def alternating_score():
    """A reward that ignores the text: 1, 0, 1, 0, ... (never a uniform group of even size)."""
    counter = itertools.count()

    def score(problem, completion):
        return float(next(counter) % 2), False

    return score


def exact_mean_kl(old: torch.Tensor, new: torch.Tensor, temperature: float) -> float:
    """Mean over rows of ``KL(softmax(old/τ) ‖ softmax(new/τ))`` in float64 (``[N, V]`` logits)."""
    logp_old = torch.log_softmax(old.double() / temperature, dim=-1)
    logp_new = torch.log_softmax(new.double() / temperature, dim=-1)
    return (logp_old.exp() * (logp_old - logp_new)).sum(-1).mean().item()


def test_kl_actual_is_the_exact_kl_of_the_update_on_the_probe_at_the_rollout_temperature(built, monkeypatch):
    import megatron_logra.rl.loop as loop

    comps, state = built
    assert comps.cfg.kl.mode != "none" and comps.cfg.kl.measure_actual
    captured: dict = {}
    real_probe_batch, real_generate, real_apply = loop._probe_batch, comps.engine.generate, comps.optimizer.apply

    def probe_batch(batch, kl_cfg, device):
        captured["probe"] = real_probe_batch(batch, kl_cfg, device)
        return captured["probe"]

    def generate(prompts, params):
        captured.setdefault("rollouts", real_generate(prompts, params))
        return captured["rollouts"]

    def apply(update, *args, **kwargs):
        probe = captured["probe"]
        captured["old"] = model_logits(comps.model, probe.tokens, probe.position_ids).detach().clone()
        return real_apply(update, *args, **kwargs)

    monkeypatch.setattr(loop, "_probe_batch", probe_batch)
    monkeypatch.setattr(comps.engine, "generate", generate)
    monkeypatch.setattr(comps.optimizer, "apply", apply)
    monkeypatch.setattr(comps.task, "score", alternating_score())
    record = loop.rl_update(comps, state)
    assert not record["skipped"] and "old" in captured

    # the probe: the first kl.probe_sequences rollouts, their completion positions in row-major order,
    # the first kl.probe_max_tokens of them
    probe, rollouts = captured["probe"], captured["rollouts"]
    assert probe.tokens.shape[0] == PROBE_SEQUENCES
    positions = []
    for i, r in enumerate(rollouts[:PROBE_SEQUENCES]):
        seq = list(r.prompt_ids) + list(r.completion_ids)
        assert probe.tokens[i, : len(seq) - 1].tolist() == seq[:-1]
        assert probe.position_ids[i, : len(seq) - 1].tolist() == list(range(len(seq) - 1))
        positions += [(i, j) for j in range(len(r.prompt_ids) - 1, len(seq) - 1)]
    assert len(positions) > PROBE_MAX_TOKENS, "the token cap must bite for this check"
    want_mask = torch.zeros_like(probe.mask)
    for i, j in positions[:PROBE_MAX_TOKENS]:
        want_mask[i, j] = True
    assert torch.equal(probe.mask, want_mask)

    new = model_logits(comps.model, probe.tokens, probe.position_ids)
    old = captured["old"]
    assert not torch.equal(old[probe.mask], new[probe.mask]), "the update did not change the probe's logits"
    want = exact_mean_kl(old[probe.mask], new[probe.mask], TEMPERATURE)
    assert want > 0
    assert record["kl_actual"] == pytest.approx(want, rel=1e-6)
    # at τ = 1 the KL differs by far more than the tolerance: the temperature is part of what is checked
    assert abs(exact_mean_kl(old[probe.mask], new[probe.mask], 1.0) / want - 1) > 1e-3
