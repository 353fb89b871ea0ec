"""The finite-difference KL probe on the module kinds of the GPU path, checked on CPU.

TransformerEngine kernels have no forward-mode rules, so TE models take the finite-difference
probe: forward hooks add ``−h·(X·Aᵀ)·Dᵀ`` to every target's output. Here that perturbation is
compared with the forward of the weights changed by hand (``W − h·D·A``, ``A`` regenerated from
the projection's public generator):

* TE-like stand-ins (classes living under a ``transformer_engine`` module path, see
  ``support.te_stand_ins``), including the fused ``LayerNormLinear`` whose weight multiplies
  ``norm(x)``, and the ``auto`` method resolving to ``finite_difference`` for them;
* megatron-core's parallel linears on a real gloo TP=2 group: ``tests/distributed/test_te_tp_gloo.py``.

Tolerance: fp32, different association only: 1e-4 of the perturbation's own size.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_logra.kl.fd_probe import perturbation_hooks
from megatron_logra.kl.probe import probe_method
from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.random_projection import projection
from support.te_stand_ins import Block

SEED, RANK = 11, 4


def _relative_error(hooked: torch.Tensor, by_hand: torch.Tensor, base: torch.Tensor) -> float:
    effect = (by_hand - base).abs().max()
    assert effect > 1e-3, "the perturbation must be visible"
    return float((hooked - by_hand).abs().max() / effect)


@pytest.mark.parametrize("normalization,zero_centered", [("RMSNorm", False), ("LayerNorm", False), ("RMSNorm", True)])
def test_perturbation_of_te_like_modules_equals_stepped_weights(normalization, zero_centered):
    torch.manual_seed(0)
    model = Block(normalization, zero_centered)
    reference = copy.deepcopy(model)
    ss = install_sketches(model, ["linear_qkv", "linear_proj"], rank=RANK, seed=SEED)
    assert probe_method("auto", ss) == "finite_difference"
    with pytest.raises(ValueError, match="TransformerEngine"):
        probe_method("jvp", ss)
    gen = torch.Generator().manual_seed(1)
    dirs = {t.key: torch.randn(t.n_out_local, RANK, generator=gen) * 0.05 for t in ss.targets}
    x = torch.randn(2, 6, 16, generator=gen)
    with torch.no_grad():
        base = model(x)
        for h in (1.0, -2.0):
            with perturbation_hooks(ss, dirs, h):
                hooked = model(x)
            for t in ss.targets:
                proj = projection(SEED, t.name, 0, RANK, t.n_in)
                reference.get_submodule(t.module_name).weight.copy_(t.weight - h * dirs[t.key] @ proj)
            assert _relative_error(hooked, reference(x), base) < 1e-4
        assert torch.equal(model(x), base)  # hooks removed, weights untouched
