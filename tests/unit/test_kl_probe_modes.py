"""The KL probes run the policy the engine samples from, whatever mode the trainer is in.

Megatron runs ``recompute_granularity=full`` only in training mode, and its checkpointed forward
drops forward-mode tangents; dropout, also on only in training mode, would make the probe's logits
random. The probes therefore run every module in eval mode and restore each module's own mode
after. Checked on the large recipes' setting (full recompute, the forward-mode probe) with hidden
dropout on: an RL update predicts a finite KL, the probe's logits are reproducible and equal a
plain eval-mode forward, and the model is back in training mode afterwards.
"""

from __future__ import annotations

import math
import warnings

import torch

from test_rl_e2e import alternating_score, small_cfg


def test_forward_mode_probe_under_full_recompute_and_dropout(tmp_path):
    from megatron_logra.kl.probe import probe_logits, probe_method
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import _probe_batch, rl_update
    from megatron_logra.train.step import Batch

    cfg = small_cfg(tmp_path / "run", "model.recompute=full", "model.hidden_dropout=0.1", "kl.probe=auto",
                    "rl.steps=1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    try:
        model = comps.model
        assert probe_method(cfg.kl.probe, comps.optimizer.sketches, comps.groups.pp_size) == "jvp"
        assert model.training and cfg.kl.mode != "none"
        comps.task.score = alternating_score()
        rec = rl_update(comps, state)
        assert rec["kl_predicted"] is not None and math.isfinite(rec["kl_predicted"]) and rec["kl_predicted"] > 0
        assert rec["kl_actual"] is not None and math.isfinite(rec["kl_actual"])
        assert all(m.training for m in model.modules())  # every module's mode restored

        n, s = 3, 24
        tokens = torch.randint(0, cfg.model.vocab_size, (n, s))
        batch = Batch(tokens=tokens, labels=tokens, loss_mask=torch.ones(n, s), position_ids=torch.arange(s)[None].expand(n, -1))
        probe = _probe_batch(batch, cfg.kl, torch.device("cpu"))
        with torch.no_grad():
            first, second = probe_logits(model, probe, comps.groups), probe_logits(model, probe, comps.groups)
            model.eval()
            plain = model(probe.tokens, probe.position_ids, None)[probe.mask]
            model.train()
            noisy = model(probe.tokens, probe.position_ids, None)[probe.mask]
        assert torch.equal(first, second) and torch.equal(first, plain)
        assert not torch.equal(noisy, plain)  # dropout is really on in training mode
    finally:
        destroy_parallel()

