"""Sketch capture and the finite-difference KL probe on a real gloo TP=2 group (megatron-core on CPU).

megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` (``sequence_parallel=True`` works on
CPU for these layers; the local spec's norms do not, so a whole GPT cannot run it here), followed by a
TE-like replicated ("duplicated") linear that sees only its rank's tokens under sequence parallelism,
with and without sequence parallelism:

* capture: sketches equal ``G·Aᵀ`` of the TP=1 dense model, with only ``P`` communicated
  (fp32, different association only: relative 1e-5 of the sketch's scale);
* the probe's perturbation hooks equal the TP=1 forward of the weights stepped by hand,
  ``W − h·D·A`` (1e-4 of the perturbation's own size).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_logra.kl.fd_probe import perturbation_hooks
from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.random_projection import projection
from support.gloo import spawn_group
from support.te_stand_ins import parallel_chain

pytestmark = pytest.mark.distributed

SEED, RANK = 11, 4


def _relative_error(hooked: torch.Tensor, by_hand: torch.Tensor, base: torch.Tensor) -> float:
    effect = (by_hand - base).abs().max()
    assert effect > 1e-3, "the perturbation must be visible"
    return float((hooked - by_hand).abs().max() / effect)


def _sp_worker(rank: int, world: int, result_dir: str) -> None:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_group()
    h, f, s, b = 16, 32, 8, 2
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(f, h, generator=gen) * 0.3, torch.randn(h, f, generator=gen) * 0.3
    w3 = torch.randn(h, h, generator=gen) * 0.3
    x, target = torch.randn(s, b, h, generator=gen), torch.randn(s, b, h, generator=gen)

    # dense TP=1 reference: G = Hᵀ X of the three layers
    d1, d2, d3 = (w.clone().requires_grad_() for w in (w1, w2, w3))
    dx = x.clone().requires_grad_()
    (F.linear(F.linear(F.gelu(F.linear(dx, d1)), d2), d3) * target).sum().backward()
    out = {}
    for sp in (True, False):
        block = parallel_chain(world, rank, sp, w1, w2, w3)
        ss = install_sketches(block, ["linear_fc1", "linear_fc2", "out_proj"], rank=RANK, seed=SEED, tp_group=tp)
        local = (lambda t: t.chunk(world, 0)[rank]) if sp else (lambda t: t)
        xin = local(x).clone().requires_grad_()
        for _ in range(2):  # two micro-batches accumulate
            y, _ = block.linear_fc1(xin)
            z, _ = block.linear_fc2(F.gelu(y))
            z, _ = block.out_proj(z)
            assert z.shape == local(x).shape
            (z * local(target)).sum().backward()
        ss.reduce_tensor_parallel()
        errs = {}
        for t, dense_grad, rows in ((ss.targets[0], d1.grad, f // world), (ss.targets[1], d2.grad, h),
                                    (ss.targets[2], d3.grad, h)):
            ref = 2 * dense_grad.double() @ projection(SEED, t.name, 0, RANK, t.n_in).double().T
            if t.parallel == "column":
                ref = ref[rank * rows:(rank + 1) * rows]
            errs[t.parallel] = float((t.sketch.double() - ref).abs().max() / ref.abs().max())
            errs[f"{t.parallel}_sp"] = t.sequence_parallel
        errs["dx"] = float((xin.grad - 2 * local(dx.grad)).abs().max())
        out[sp] = errs
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


def test_sequence_parallel_sketches_equal_tp1_dense_gradients_over_gloo(tmp_path):
    spawn_group(_sp_worker, 2, tmp_path, str(tmp_path), tensor_parallel=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        for sp, errs in res.items():
            assert errs["column_sp"] is sp and errs["row_sp"] is sp and errs["none_sp"] is sp
            assert errs["column"] < 1e-5 and errs["row"] < 1e-5 and errs["none"] < 1e-5, (sp, errs)
            assert errs["dx"] < 1e-5, (sp, errs)


def _tp_worker(rank: int, world: int, result_dir: str) -> None:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_group()
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


def test_perturbation_under_tensor_and_sequence_parallelism_equals_tp1_stepped_forward(tmp_path):
    spawn_group(_tp_worker, 2, tmp_path, str(tmp_path), tensor_parallel=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, res in enumerate(results):
        assert res[True]["kinds"] == [("column", True), ("row", True), ("none", True)]
        assert res[False]["kinds"] == [("column", False), ("row", False), ("none", False)]
        for sp in (True, False):
            assert res[sp]["base"] < 1e-5, (rank, sp, res[sp])
            assert res[sp]["rel"] < 1e-4, (rank, sp, res[sp])
