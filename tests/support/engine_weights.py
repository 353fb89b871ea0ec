"""Whether a rollout engine holds the trainer's weights bitwise: what the sync tests check after every update."""

from __future__ import annotations

import torch


def engine_differs_from_trainer(comps) -> list[str]:
    """Names of the embedded engine's tensors that differ (bitwise) from the trainer's full weights streamed in Hugging
    Face layout; the two must hold the same names."""
    from megatron_logra.rl.weights import iter_hf_params

    engine = dict(comps.engine.model.named_parameters())
    seen, differ = set(), []
    for name, full in iter_hf_params(comps.model, comps.groups, comps.cfg.model):
        seen.add(name)
        mine = engine[name].detach()
        if mine.shape != full.shape or not torch.equal(mine, full.to(mine.dtype)):
            differ.append(name)
    assert seen == set(engine), sorted(set(engine) ^ seen)
    return differ
