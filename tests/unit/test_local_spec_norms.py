"""The local spec's norms are torch norms in every slot, the final one included, whatever else imports.

megatron-core picks a layer spec's final norm itself (TE's norm when TransformerEngine imports, else
apex's FusedLayerNorm when apex does) and its local spec takes apex's FusedLayerNorm for LayerNorm
layers. NVIDIA's images ship both, and neither has a forward-mode derivative (the predicted-KL probe)
nor, for apex, RMSNorm. Here a fused-style norm stands in for them in megatron's import-time choice
(this machine has neither): the built model must not contain it, and forward-mode AD must run.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_logra.models.gpt import ModelConfig, build_gpt


class _FusedStandIn(nn.Module):
    """What megatron's import-time choice yields with TE / apex: a norm through a custom autograd
    Function without a forward-mode rule."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return g

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return self._Fn.apply(x) * self.weight


def _norms(model: nn.Module) -> dict[str, type]:
    """Every norm module (the spec's unused norm slots are megatron's IdentityOp: left out)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return {name: type(m) for name, m in model.named_modules()
            if not isinstance(m, IdentityOp) and (name.endswith("layernorm")
                                                  or isinstance(m, (nn.LayerNorm, nn.RMSNorm, _FusedStandIn)))}


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_every_norm_of_a_local_model_is_a_torch_norm(groups, one_thread, monkeypatch, normalization, qk_layernorm):
    from megatron.core.models import backends
    from megatron.core.transformer import transformer_block

    monkeypatch.setattr(transformer_block, "LayerNormImpl", _FusedStandIn)  # as with TE or apex installed
    monkeypatch.setattr(backends, "LNImpl", _FusedStandIn)  # as with apex installed
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                      seq_length=8, normalization=normalization, qk_layernorm=qk_layernorm,
                      transformer_impl="local")
    model = build_gpt(cfg, groups, seed=1)
    norms = _norms(model)
    want = nn.RMSNorm if normalization == "RMSNorm" else nn.LayerNorm
    assert "decoder.final_layernorm" in norms
    assert len(norms) == 1 + 2 * (2 + (2 if qk_layernorm else 0)), norms  # final + per layer: input, pre-MLP (+ q, k)
    assert set(norms.values()) == {want}, norms

    # the predicted-KL probe (forward-mode AD through the whole model) runs on it
    from megatron_logra.kl.probe import ProbeBatch, predicted_kl, probe_method
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.train.step import Batch, forward_backward

    opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=4, recipe="paper"),
                                                 native=NativeConfig(freeze=True)), groups)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen)
    pos, mask = torch.arange(8)[None].expand(2, 8).contiguous(), torch.ones(2, 8)
    opt.zero_grad()
    update = opt.prepare(num_tokens=forward_backward(model, [Batch(tokens, labels, mask, pos)], groups).num_tokens)
    assert probe_method("auto", opt.sketches) == "jvp"
    pred, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, ProbeBatch(tokens, pos, mask),
                           groups)
    assert math.isfinite(pred) and pred > 0
