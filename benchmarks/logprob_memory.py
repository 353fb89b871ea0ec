#!/usr/bin/env python
"""Peak memory of per-token log-probs: dense fp32 softmax vs chunked (rl/logprobs.py), forward + backward.

For bf16 logits ``[b, s, V]`` (``b·s`` tokens, one TP rank holding the whole vocabulary) this runs
``Σ c·logp`` forward and backward (the gradient w.r.t. the logits is what megatron's output layer
consumes) with

* ``dense log_softmax``: ``log_softmax(z.float() / τ)`` gathered at the labels;
* ``megatron CE (before)``: the previous ``token_logprobs``, megatron-core's
  ``vocab_parallel_cross_entropy`` on ``z.float() / τ``;
* ``chunked C``: ``chunked_token_logprobs`` with ``C`` tokens per chunk (``0`` = one chunk).

How memory is measured (CPU: ``torch.cuda`` memory statistics do not exist here):

1. *Live tensor bytes* — :class:`megatron_logra.memory.measure.LiveTensorTracker`: a
   ``TorchDispatchMode`` registers the storage of every tensor an aten op returns (forward, the
   custom function's chunks, autograd's backward on this thread) once, and ``weakref.finalize`` on
   the storage removes it when torch frees it; tensors alive at the start (logits, labels) are
   registered too. Reported: the peak above the start (everything forward + backward created,
   including the ``[T, V]`` gradient itself), and that peak as a multiple of the bf16 logits. Not
   seen: scratch memory inside a kernel that never reaches the dispatcher.
2. *Peak RSS* — every configuration runs in its own child process; ``ru_maxrss`` is reset
   (``/proc/self/clear_refs``) after the inputs exist and read after one untracked forward +
   backward. glibc returns large blocks to the OS on free (mmap threshold), so the RSS peak follows
   the tensors and also sees kernel scratch memory and allocator overhead.

``torch.profiler(profile_memory=True)`` was not used: it records per-op allocation events, but its
peak must be reconstructed from them and it does not attribute frees inside the custom autograd
function's chunks to a phase; the tracker gives the same live-byte total directly.

    OMP_NUM_THREADS=1 python benchmarks/logprob_memory.py            # 4096 x 32768 and 4096 x 151936 (~10 min, 8 GiB)
    python benchmarks/logprob_memory.py --shapes 4096x65536 --chunks 512,2048

Writes ``--out``; without it the documented run (the default ``--shapes``, ``--chunks`` and ``--threads``)
writes the committed ``benchmarks/results/logprob_memory.md`` and any other run
``runs/bench-logprob-memory/logprob_memory.md``, so a smaller run never replaces the committed table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from megatron_logra.argtypes import positive_int
from megatron_logra.bench.outputs import refuse_unwritable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MiB = 1024 * 1024
TAU = 0.8
DEFAULT_SHAPES, DEFAULT_CHUNKS, DEFAULT_THREADS = "4096x32768,4096x151936", "256,1024,0", 1
COMMITTED = HERE / "results" / "logprob_memory.md"
"""The committed table: written by default only by the documented run (default shapes, chunks, threads)."""
OTHER_RUNS = Path("runs/bench-logprob-memory/logprob_memory.md")
""":data:`COMMITTED`'s stand-in (relative to the working directory) for a run of other settings."""


def _child(impl: str, tokens: int, vocab: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from megatron_logra.memory.measure import LiveTensorTracker
    from megatron_logra.memory.measure import maxrss_bytes as _maxrss_bytes
    from megatron_logra.memory.measure import reset_peak_rss as _reset_peak_rss
    from megatron_logra.memory.measure import rss_bytes as _rss_bytes

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if impl == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        from megatron_logra.parallel import ParallelConfig, initialize_parallel

        initialize_parallel(ParallelConfig(), seed=1)

        def fn(z, labels):
            scaled = z.float() / TAU
            return -vocab_parallel_cross_entropy(scaled.transpose(0, 1).contiguous(), labels.t().contiguous()).t()
    elif impl == "dense":
        def fn(z, labels):
            return torch.log_softmax(z.float() / TAU, dim=-1).gather(-1, labels[..., None])[..., 0]
    else:
        from megatron_logra.rl.logprobs import chunked_token_logprobs

        chunk = int(impl.split(":")[1])

        def fn(z, labels):
            return chunked_token_logprobs(z, labels, TAU, None, chunk)

    b = 2
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(b, tokens // b, vocab, generator=gen) * 2.0).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (b, tokens // b), generator=gen)
    coef = torch.randn(b, tokens // b, generator=gen)

    def run() -> torch.Tensor:
        z.grad = None
        logp = fn(z, labels)
        (logp * coef).sum().backward()
        return logp.detach()

    run()  # warm-up on the same shapes (lazy initialisation, first-touch page faults)
    z.grad = None
    base_rss = _rss_bytes()
    reset = _reset_peak_rss()
    t0 = time.perf_counter()
    logp = run()
    seconds = time.perf_counter() - t0
    peak_rss = _maxrss_bytes() - base_rss
    z.grad = None
    tracker = LiveTensorTracker()
    with tracker:
        tracker.set_phase("fwd_bwd")
        run()
    return {
        "impl": impl, "tokens": tokens, "vocab": vocab, "logits_bytes": z.numel() * z.element_size(),
        "live_peak_above_start": tracker.peak - tracker.start_bytes,
        "live_forward_peak_above_start": tracker.phase_peaks.get("forward", tracker.start_bytes) - tracker.start_bytes,
        "peak_phase": tracker.peak_phase, "rss_peak_above_start": peak_rss, "rss_reset": reset, "seconds": seconds,
        "logp": logp.reshape(-1).tolist(),
    }


def run_child(impl: str, tokens: int, vocab: int, threads: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", impl, "--shapes", f"{tokens}x{vocab}"]
    # a fixed mmap threshold: glibc would otherwise raise it after the warm-up frees, and keep freed
    # blocks in the heap, so the RSS peak of the measured run would miss them
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} at {tokens}x{vocab} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def label(impl: str) -> str:
    if impl == "dense":
        return "dense log_softmax (fp32)"
    if impl == "megatron":
        return "megatron CE on fp32 (before)"
    chunk = int(impl.split(":")[1])
    return f"chunked, {chunk} tokens/chunk" if chunk else "chunked, one chunk"


def table(rows: list[dict]) -> list[str]:
    head = ["tokens x vocab", "implementation", "live peak MiB (fwd+bwd)", "x bf16 logits", "vs dense",
            "fwd-only live MiB", "peak RSS MiB", "RSS vs dense", "time s", "max |Δ logp| vs dense"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = next(x for x in rows if x["tokens"] == r["tokens"] and x["vocab"] == r["vocab"] and x["impl"] == "dense")
        out.append("| " + " | ".join([
            f"{r['tokens']} x {r['vocab']}", label(r["impl"]), f"{r['live_peak_above_start'] / MiB:.0f}",
            f"{r['live_peak_above_start'] / r['logits_bytes']:.2f}",
            f"{r['live_peak_above_start'] / base['live_peak_above_start']:.2f}x",
            f"{r['live_forward_peak_above_start'] / MiB:.0f}", f"{r['rss_peak_above_start'] / MiB:.0f}",
            f"{r['rss_peak_above_start'] / max(base['rss_peak_above_start'], 1):.2f}x", f"{r['seconds']:.2f}",
            f"{max(abs(a - b) for a, b in zip(r['logp'], base['logp'])):.1e}",
        ]) + " |")
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``--shapes``: comma list of ``TOKENSxVOCAB``, TOKENS even (two sequences) and VOCAB positive."""
    out = []
    for part in text.split(","):
        try:
            tokens, vocab = (int(x) for x in part.strip().split("x"))
        except ValueError:
            tokens = vocab = 0
        if tokens < 2 or tokens % 2 or vocab < 1:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not TOKENSxVOCAB: expected a comma list such as 4096x32768,4096x151936 "
                "(TOKENS a positive even integer, VOCAB a positive integer)")
        out.append((tokens, vocab))
    return out


def parse_chunks(text: str) -> list[int]:
    """``--chunks``: comma list of tokens per chunk, integers >= 0 (0 = one chunk)."""
    try:
        chunks = [int(c) for c in text.split(",")]
    except ValueError:
        chunks = [-1]
    if any(c < 0 for c in chunks):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers >= 0, such as 256,1024,0")
    return chunks


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                   help=f"comma list of TOKENSxVOCAB (default {DEFAULT_SHAPES})")
    p.add_argument("--chunks", type=parse_chunks, default=DEFAULT_CHUNKS,
                   help=f"tokens per chunk of the chunked runs (0 = one chunk; default {DEFAULT_CHUNKS})")
    p.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS,
                   help=f"torch threads of each child (default {DEFAULT_THREADS})")
    p.add_argument("--out", type=Path, default=None,
                   help="report file (default: benchmarks/results/logprob_memory.md for the default --shapes, "
                        f"--chunks and --threads, else {OTHER_RUNS})")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = args.shapes
    if args.child:
        print(json.dumps(_child(args.child, *shapes[0])))
        return
    if args.out is None:
        documented = (shapes == parse_shapes(DEFAULT_SHAPES) and args.chunks == parse_chunks(DEFAULT_CHUNKS)
                      and args.threads == DEFAULT_THREADS)
        args.out = COMMITTED if documented else OTHER_RUNS
    refuse_unwritable(p, "--out", args.out)
    impls = ["dense", "megatron"] + [f"chunked:{c}" for c in args.chunks]
    t0 = time.time()
    rows = []
    for tokens, vocab in shapes:
        for impl in impls:
            rows.append(run_child(impl, tokens, vocab, args.threads))
            print(f"  {tokens}x{vocab} {label(impl)}: live peak {rows[-1]['live_peak_above_start'] / MiB:.0f} MiB, "
                  f"RSS peak {rows[-1]['rss_peak_above_start'] / MiB:.0f} MiB", file=sys.stderr)
    lines = table(rows)
    print("\n".join(lines))
    import torch

    cmd = "OMP_NUM_THREADS=1 " + shlex.join(["python", os.path.relpath(__file__, REPO),
                                             *(argv if argv is not None else sys.argv[1:])])
    doc = [
        "# Log-prob memory: dense fp32 softmax vs chunked", "",
        f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{time.time() - t0:.0f} s). bf16 logits `[2, tokens/2, vocab]`, temperature {TAU}, forward and backward "
        "of `Σ c·logp` (the bf16 gradient w.r.t. the logits is included in every peak).", "",
        *lines, "",
        "- live peak: peak of live tensor bytes above the start (inputs already alive), from a TorchDispatchMode that "
        "registers every storage an op returns and drops it when torch frees it (`LiveTensorTracker` of "
        "`megatron_logra/memory/measure.py`); fwd-only: the same during forward.",
        "- peak RSS: `ru_maxrss` of the configuration's own child process, reset after the inputs exist, above the RSS "
        "at that point (sees kernel scratch and allocator overhead too).",
        "- max |Δ logp| vs dense: largest per-token difference of the log-probs from the dense fp32 ones.",
        "- time s: wall time of one forward + backward on one thread of a shared 2-core machine (other jobs "
        "running): indicative only.", "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(doc))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
