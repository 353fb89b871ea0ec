"""The finite-difference KL probe on the module kinds of the GPU path, checked on CPU.

TransformerEngine kernels have no forward-mode rules, so TE models take the finite-difference
probe: forward hooks add ``−h·(X·Aᵀ)·Dᵀ`` to every target's output. Here that perturbation is
compared with the forward of the weights changed by hand (``W − h·D·A``, ``A`` regenerated from
the projection's public generator):

* TE-like stand-ins (classes living under a ``transformer_engine`` module path, see
  ``test_te_capture_cpu``), including the fused ``LayerNormLinear`` whose weight multiplies
  ``norm(x)``, and the ``auto`` method resolving to ``finite_difference`` for them;
* megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` on a real gloo TP=2 group, with
  and without sequence parallelism, followed by a replicated TE-like layer, against the TP=1
  dense forward.

Tolerance: fp32, different association only: 1e-4 of the perturbation's own size.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron_logra.kl.fd_probe import perturbation_hooks
from megatron_logra.kl.probe import probe_method
from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.random_projection import projection
from test_te_capture_cpu import Block, destroy_gloo_tp, init_gloo_tp, parallel_chain

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


def _tp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    tp = init_gloo_tp(rank, world, init_file)
    h, f, s, b, step = 16, 32, 8, 2, 1.5
    gen = torch.Generator().manual_seed(0)  # the same draws on every rank
    w1, w2 = torch.randn(f, h, generator=gen) * 0.3, torch.randn(h, f, generator=gen) * 0.3
    w3 = torch.randn(h, h, generator=gen) * 0.3
    x = torch.randn(s, b, h, generator=gen)
    d1, d2, d3 = (torch.randn(n, RANK, generator=gen) * 0.05 for n in (f, h, h))
    out = {}
    for sp in (True, False):
        block = parallel_chain(world, rank, sp, w1, w2, w3)
        ss = install_sketches(block, ["linear_fc1", "linear_fc2", "out_proj"], rank=RANK, seed=SEED, tp_group=tp)
        fc1, fc2, proj3 = ss.targets
        dirs = {fc1.key: d1.chunk(world, 0)[rank], fc2.key: d2, proj3.key: d3}
        local = (lambda t: t.chunk(world, 0)[rank]) if sp else (lambda t: t)

        def forward():
            y, _ = block.linear_fc1(local(x))
            z, _ = block.linear_fc2(F.gelu(y))
            return block.out_proj(z)[0]

        with torch.no_grad():
            base = forward()
            with perturbation_hooks(ss, dirs, step, tp):
                hooked = forward()
            # TP=1 dense forward of the stepped weights
            a1, a2, a3 = (projection(SEED, t.name, 0, RANK, t.n_in) for t in (fc1, fc2, proj3))
            v1, v2, v3 = w1 - step * d1 @ a1, w2 - step * d2 @ a2, w3 - step * d3 @ a3
            by_hand = local(F.linear(F.linear(F.gelu(F.linear(x, v1)), v2), v3))
            dense_base = local(F.linear(F.linear(F.gelu(F.linear(x, w1)), w2), w3))
        out[sp] = {"rel": _relative_error(hooked, by_hand, dense_base),
                   "base": float((base - dense_base).abs().max()),
                   "kinds": [(t.parallel, t.sequence_parallel) for t in ss.targets]}
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    destroy_gloo_tp()


def test_perturbation_under_tensor_and_sequence_parallelism_equals_tp1_stepped_forward():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_tp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for rank, res in enumerate(results):
        assert res[True]["kinds"] == [("column", True), ("row", True), ("none", True)]
        assert res[False]["kinds"] == [("column", False), ("row", False), ("none", False)]
        for sp in (True, False):
            assert res[sp]["base"] < 1e-5, (rank, sp, res[sp])
            assert res[sp]["rel"] < 1e-4, (rank, sp, res[sp])
