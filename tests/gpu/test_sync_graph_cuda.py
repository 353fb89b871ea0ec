"""The sketch-delta commit replayed as a CUDA graph gives the bits of an eager apply (``sync.graph``).

An engine with ``ProjectionCache(cuda_graphs=True)`` captures the commit once per delta structure and
decay kind and replays it; its weights must equal, bit for bit, those of an engine that applies every
delta eagerly, and of the CPU (the trainer's merge). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype,rounding", [(torch.float32, "nearest"), (torch.bfloat16, "stochastic")])
@pytest.mark.parametrize("layout,tp", [("hf", 1), ("sglang", 2)])
def test_graph_replays_equal_eager_applies_and_the_cpu_bitwise(dtype, rounding, layout, tp):
    from megatron_logra.sync.apply import ProjectionCache, apply_delta_
    from megatron_logra.sync.layout import plan_for
    from megatron_logra.sync.synthetic import DenseShape, random_delta

    shape = DenseShape(hidden=512, layers=2, heads=8, kv_heads=2, ffn=1536, vocab=64)
    rank = 32
    for tp_rank in range(tp):
        plan = plan_for(random_delta(shape, rank), layout, tp, tp_rank)
        gen = torch.Generator().manual_seed(tp_rank)
        cpu = {}
        for f in plan.factors:
            cols = len(f.cols) if f.cols is not None else f.n_in
            cpu[f.param] = (0.02 * torch.randn(f.U_OR.shape[0], cols, generator=gen)).to(dtype)
        graphed = {k: v.cuda() for k, v in cpu.items()}
        eager = {k: v.cuda() for k, v in cpu.items()}
        cache, version = ProjectionCache(cuda_graphs=True), 0
        for v in range(6):
            delta = random_delta(shape, rank, base_version=v, new_version=v + 1, seed=3, scale=1e-3, generator_seed=v,
                                 rounding=rounding)
            delta.decay = 1.0 if v % 2 else 0.999
            kw = dict(layout=layout, tp_size=tp, tp_rank=tp_rank)
            version = apply_delta_(graphed, delta, version, cache=cache, **kw)
            apply_delta_(eager, delta, v, **kw)
            apply_delta_(cpu, delta, v, **kw)
            torch.cuda.synchronize()
            for k in cpu:
                assert torch.equal(graphed[k], eager[k]), (k, v)
                assert torch.equal(graphed[k].cpu(), cpu[k]), (k, v)
        graphs = cache._static.graphs
        assert set(graphs) == {True, False} and all(g is not None for g in graphs.values())
