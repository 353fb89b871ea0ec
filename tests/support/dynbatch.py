"""One RL step's stateless parts for a given micro-batch token budget (``rl.max_tokens_per_micro_batch``): what
the dynamic micro-batch tests compare between layouts."""

from __future__ import annotations

import random

import torch


def skewed_batch(comps, lengths: list[int], seed: int = 0):
    """A packed batch of completions of ``lengths`` after 2–5-token prompts; random advantages and log-probs."""
    from megatron_logra.rl.batching import pack_sequences

    gen = random.Random(seed)
    vocab = len(comps.tokenizer)
    prompts = [[gen.randrange(1, vocab) for _ in range(gen.randrange(2, 6))] for _ in lengths]
    completions = [[gen.randrange(1, vocab) for _ in range(n)] for n in lengths]
    return pack_sequences(prompts, completions, rollout_logprobs=[[-gen.uniform(0.5, 5) for _ in c] for c in completions],
                          advantages=[gen.uniform(-1, 1) for _ in lengths], finished=[n % 3 > 0 for n in lengths],
                          pad_id=comps.tokenizer.pad_token_id, max_length=comps.cfg.model.seq_length,
                          multiple=comps.cfg.sequence_multiple())


def step_parts(comps, batch, budget: int) -> dict:
    """With ``rl.max_tokens_per_micro_batch=budget``: the reference log-probs (with a reference model), the step's
    result and prepared update, its micro-batches and positions, and each target's reduced gradient sketch (the
    optimizer's moments advance with every ``prepare``; the sketch does not depend on them)."""
    from megatron_logra.profiling.phases import Phases
    from megatron_logra.rl.objective import _reference_logprobs, backward_and_prepare, make_rl_loss_fn, step_plan

    comps.cfg.rl.max_tokens_per_micro_batch = budget
    try:
        batch = type(batch)(batch.tokens, batch.labels, batch.loss_mask, batch.position_ids, dict(batch.extras))
        ref = None
        if comps.ref_model is not None:
            ref = _reference_logprobs(comps, batch)
            batch.extras["ref_logprobs"] = ref
        plan = step_plan(comps, batch)
        loss_fn = make_rl_loss_fn(comps.cfg.rl.loss, comps.cfg.rl.rollout.temperature, comps.groups.tp)
        with Phases("test") as ph:
            result, update, _ = backward_and_prepare(comps, batch, loss_fn, 1, ph)
        return {"ref": ref, "result": result, "update": update, "micro_batches": len(plan),
                "positions": sum(len(p.rows) * p.length for p in plan),
                "sketches": {t.key: t.sketch.clone() for t in comps.optimizer.targets}}
    finally:
        comps.cfg.rl.max_tokens_per_micro_batch = 0


def largest_sketch_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Over targets, the largest entry difference relative to the target's largest entry of ``a``."""
    assert set(a) == set(b) and a
    return max(((b[k].double() - v.double()).abs().max() / v.double().abs().max()).item() for k, v in a.items())
