"""The KL probe's forwards run with FP8 off (``models.te.without_fp8``), whatever the training forward uses.

A finite-difference step is far below FP8's spacing, so the probe runs the 16-bit policy (the one the
rollout engine samples). On a CPU megatron's local GPT takes ``config.fp8`` without TE (its FP8 context
is then a no-op), which is enough to see which forwards would have entered it: a hook records the
``fp8`` field every transformer layer sees when it runs.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.models.te import without_fp8

V = 64


@pytest.fixture(scope="module")
def model(groups):
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    net = build_gpt(ModelConfig(vocab_size=V, seq_length=16), groups, seed=3)
    return net


def _layers(model):
    return [m for m in model.modules() if type(m).__name__ == "TransformerLayer"]


def _record(model, seen: list):
    return [layer.register_forward_pre_hook(lambda mod, args: seen.append(mod.config.fp8)) for layer in _layers(model)]


def test_without_fp8_clears_every_config_and_restores_it_also_on_error(model):
    layer = _layers(model)[0]
    own = type(layer.config)(**{**vars(layer.config)})  # a layer with a config object of its own
    own.fp8 = "e4m3"
    shared = model.config
    layer.config, saved_config = own, layer.config
    shared.fp8 = "hybrid"
    try:
        with without_fp8(model):
            assert shared.fp8 is None and own.fp8 is None
        assert shared.fp8 == "hybrid" and own.fp8 == "e4m3"
        with pytest.raises(RuntimeError, match="boom"):
            with without_fp8([model]):  # pipeline chunks
                assert shared.fp8 is None
                raise RuntimeError("boom")
        assert shared.fp8 == "hybrid" and own.fp8 == "e4m3"
    finally:
        layer.config = saved_config
        shared.fp8 = None


def test_probe_and_measured_kl_forwards_run_without_fp8_while_training_forwards_keep_it(model, groups):
    from megatron_logra.kl.probe import ProbeBatch, measure_kl, probe_logits

    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)[None].expand(2, -1).contiguous()
    probe = ProbeBatch(tokens, pos, torch.ones(2, 16))
    seen: list = []
    handles = _record(model, seen)
    model.config.fp8 = "hybrid"
    try:
        old = probe_logits(model, probe, groups)
        assert measure_kl(model, probe, old, groups) == pytest.approx(0.0, abs=1e-9)
        probe_seen, seen[:] = list(seen), []
        model(tokens, pos, None)  # a training forward
        assert probe_seen and all(fp8 is None for fp8 in probe_seen), probe_seen
        assert seen and all(fp8 == "hybrid" for fp8 in seen), seen
    finally:
        model.config.fp8 = None
        for h in handles:
            h.remove()
