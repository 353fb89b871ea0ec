#!/usr/bin/env python
"""Dense refit memory: the whole-model gather vs the streamed refit (``rl.weights``).

A dense refit copies every trainer weight into the rollout engine: at start, on drift, at
anchors and with ``sync.mode=full``. Gathering the whole model first (``gather_full_model`` +
``megatron_to_hf``: an fp32 copy of every parameter plus its HF-named copy) costs ~8 bytes per
parameter on top of the model -- 216 GB at 27B, more than a GPU holds. The streamed refit
(``iter_hf_params``) yields one full parameter at a time.

For bf16 megatron-core GPTs of a few sizes (one process, TP = PP = 1), both refits load the same
embedded engine, side by side in one run (alternating which goes first). Measured per refit, with
:class:`megatron_logra.memory.measure.LiveTensorTracker` (exact live tensor bytes, by storage):
the peak of live tensors above what was alive before the refit, next to the memory planner's
policy-sync bound for the engine side of the stream: 2 x the largest full parameter (the planner
adds one 512 MiB chunk for SGLang, which the embedded engine does not queue). Also the median
time of each refit and a check that both leave bitwise equal engine weights.

    python benchmarks/refit_memory.py [--sizes 512x4,1024x8] [--repeats 3] [--out FILE]

Results: a table on stdout and in ``--out``. Without ``--out`` the documented run (the default
``--sizes`` and ``--repeats``) writes the committed ``benchmarks/results/refit_memory.md``; any other
run writes ``runs/bench-refit-memory/refit_memory.md``, so a smaller run never replaces the
committed table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

DEFAULT_SIZES, DEFAULT_REPEATS = "512x4,1024x8", 3
COMMITTED = Path(__file__).resolve().parent / "results" / "refit_memory.md"
"""The committed table: written by default only by the documented run (default sizes and repeats)."""
OTHER_RUNS = Path("runs/bench-refit-memory/refit_memory.md")
""":data:`COMMITTED`'s stand-in (relative to the working directory) for a run of other settings."""

import torch  # noqa: E402

from megatron_logra.argtypes import positive_int  # noqa: E402
from megatron_logra.bench.outputs import refuse_unwritable  # noqa: E402
from megatron_logra.memory.measure import LiveTensorTracker  # noqa: E402

MiB = 1 << 20


def _measure(fn) -> tuple[int, float]:
    """(peak live tensor bytes above the start, seconds) of ``fn()``."""
    import gc

    gc.collect()
    with LiveTensorTracker() as tracker:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return tracker.peak - tracker.start_bytes, seconds


def run_size(hidden: int, layers: int, repeats: int) -> dict:
    from megatron_logra.memory.count import count_params
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.rl.weights import gather_full_model, iter_hf_params
    from megatron_logra.rollout.embedded import EmbeddedEngine

    groups = run_size.groups
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                      num_query_groups=max(1, hidden // 256), ffn_hidden_size=4 * hidden, vocab_size=32000,
                      seq_length=512, params_dtype="bfloat16")
    model = build_gpt(cfg, groups, seed=1)
    engine = EmbeddedEngine(cfg, dtype=torch.bfloat16, init_seed=2)
    version = [0]

    def whole() -> None:
        version[0] += 1
        engine.update_weights_full(megatron_to_hf(gather_full_model(model, groups), cfg), version[0])

    def streamed() -> None:
        version[0] += 1
        engine.update_weights_full(iter_hf_params(model, groups, cfg), version[0])

    fns = {"whole": whole, "streamed": streamed}
    peaks: dict[str, list[int]] = {k: [] for k in fns}
    times: dict[str, list[float]] = {k: [] for k in fns}
    snapshots = {}
    for i in range(repeats):
        for name in (["whole", "streamed"] if i % 2 == 0 else ["streamed", "whole"]):
            peak, seconds = _measure(fns[name])
            peaks[name].append(peak)
            times[name].append(seconds)
            snapshots[name] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    equal = all(torch.equal(snapshots["whole"][n], snapshots["streamed"][n]) for n in snapshots["whole"])
    counts = count_params(cfg)
    return {
        "label": f"hidden {hidden} x {layers}", "params": counts.total, "model_bytes": counts.weight_bytes,
        "whole": max(peaks["whole"]), "streamed": max(peaks["streamed"]),
        "t_whole": statistics.median(times["whole"]), "t_streamed": statistics.median(times["streamed"]),
        "bound": 2 * counts.largest_full_bytes, "equal": equal,
    }


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``--sizes``: comma list of ``HIDDENxLAYERS``, positive integers; HIDDEN splits into ``HIDDEN // 64``
    heads in ``HIDDEN // 256`` query groups (as ``run_size`` builds the model)."""
    out = []
    for part in text.split(","):
        try:
            hidden, layers = (int(x) for x in part.strip().split("x"))
        except ValueError:
            hidden = layers = 0
        if hidden < 1 or layers < 1:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not HIDDENxLAYERS: expected a comma list of positive integers such as 512x4,1024x8")
        heads, groups = max(1, hidden // 64), max(1, hidden // 256)
        if hidden % heads or heads % groups:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r}: hidden {hidden} gives {heads} heads in {groups} query groups, which do not divide "
                "(use a multiple of 256, or of 64 below 512)")
        out.append((hidden, layers))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                   help=f"HIDDENxLAYERS, comma separated (default {DEFAULT_SIZES})")
    p.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                   help=f"refits of each kind per size (default {DEFAULT_REPEATS})")
    p.add_argument("--out", type=Path, default=None,
                   help="report file (default: benchmarks/results/refit_memory.md for the default --sizes and "
                        f"--repeats, else {OTHER_RUNS})")
    args = p.parse_args()
    if args.out is None:
        documented = args.sizes == parse_sizes(DEFAULT_SIZES) and args.repeats == DEFAULT_REPEATS
        args.out = COMMITTED if documented else OTHER_RUNS
    refuse_unwritable(p, "--out", args.out)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from megatron_logra.parallel import ParallelConfig, initialize_parallel

    run_size.groups = initialize_parallel(ParallelConfig(), seed=1)
    lines = ["| model | params (bf16 MiB) | whole-model refit: extra peak | streamed refit: extra peak | "
             "streamed / whole | planner bound 2 x largest param | within | time whole / streamed | "
             "same engine weights |",
             "|---|---:|---:|---:|---:|---:|:---:|---:|:---:|"]
    ok = True
    for hidden, layers in args.sizes:
        r = run_size(hidden, layers, args.repeats)
        within = r["streamed"] <= r["bound"]
        ok &= within and r["equal"]
        lines.append(
            f"| {r['label']} | {r['params'] / 1e6:.1f}M ({r['model_bytes'] / MiB:.0f}) | {r['whole'] / MiB:.1f} MiB | "
            f"{r['streamed'] / MiB:.1f} MiB | **{r['streamed'] / r['whole']:.3f}x** | {r['bound'] / MiB:.1f} MiB | "
            f"{'yes' if within else 'NO'} | {r['t_whole']:.2f} / {r['t_streamed']:.2f} s | "
            f"{'yes' if r['equal'] else 'NO'} |")
        print(lines[-1], flush=True)
    text = "\n".join([f"Command: `{shlex.join(['python', 'benchmarks/refit_memory.py', *sys.argv[1:]])}`", "",
                      "Extra peak = live tensor bytes above those alive before the refit (exact, by storage).", ""]
                     + lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
