"""Per-sync host time of the SGLang loader's apply: validate, then apply (two passes of checks) vs staged.

An engine at TP > 1 must agree across its ranks before any rank writes. The loader used to run the full
validation (:func:`megatron_logra.sync.apply.validate`: the layout plan of every target, the shape and
dtype of every engine weight) and then the apply, which with a warm ``ProjectionCache`` checks the delta
again; it now stages (:func:`~megatron_logra.sync.apply.stage_delta`: the cached checks and every
allocation), agrees, and commits. This measures both sequences side by side, interleaved, on weights in
SGLang's fused layout, for many thin layers (so the host work per target, not the arithmetic, dominates,
as on a GPU) and one wider model. Prints a markdown table; medians over ``--repeats`` syncs each.

    python benchmarks/loader_overhead.py [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_logra.argtypes import positive_int
from megatron_logra.sync.apply import ProjectionCache, apply_delta_, stage_delta, validate
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.synthetic import DenseShape, random_delta

SHAPES = {
    "62 thin layers (27B's depth), hidden 128": DenseShape(hidden=128, layers=62, heads=8, kv_heads=4, ffn=256,
                                                            vocab=256),
    "28 layers (1.5B's depth), hidden 512": DenseShape(hidden=512, layers=28, heads=8, kv_heads=2, ffn=1536,
                                                       vocab=1024),
}


def _run(shape: DenseShape, rank: int, repeats: int) -> tuple[int, float, float]:
    plan = plan_for(random_delta(shape, rank), "sglang", 1, 0)
    deltas = [random_delta(shape, rank, base_version=v, new_version=v + 1, seed=3, generator_seed=v)
              for v in range(repeats + 2)]
    engines = {}
    for mode in ("validate+apply", "staged"):
        weights = {f.param: torch.zeros(f.U_OR.shape[0], f.n_in, dtype=torch.bfloat16) for f in plan.factors}
        engines[mode] = (weights, ProjectionCache())
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for v, d in enumerate(deltas):
        for mode, (weights, cache) in engines.items():  # interleaved: both see the same machine state
            t0 = time.perf_counter()
            if mode == "staged":
                stage_delta(weights, d, v, layout="sglang", cache=cache).commit_()
            else:
                validate(d, weights, v, layout="sglang")
                apply_delta_(weights, d, v, layout="sglang", cache=cache)
            if v >= 2:  # the first two prepare the cache
                times[mode].append(time.perf_counter() - t0)
    a, b = engines["validate+apply"][0], engines["staged"][0]
    assert all(torch.equal(a[k], b[k]) for k in a), "the two sequences must write the same weights"
    return len(plan.factors), statistics.median(times["validate+apply"]), statistics.median(times["staged"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=positive_int, default=15, help="timed syncs per sequence and model")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    p.add_argument("--rank", type=positive_int, default=32, help="sketch rank of the deltas")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = ["| engine weights (bf16, SGLang layout) | targets | validate + apply ms | staged ms | staged / before |",
            "|---|---:|---:|---:|---:|"]
    for label, shape in SHAPES.items():
        n, before, now = _run(shape, args.rank, args.repeats)
        rows.append(f"| {label} | {n} | {before * 1e3:.1f} | {now * 1e3:.1f} | {now / before:.2f}x |")
    print(f"rank {args.rank}, {args.threads} thread(s), median of {args.repeats} syncs each\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
