"""Sketch-delta policy sync: bytes per sync and engine-side time, vs a full bf16 refit.

Bytes: for the tiny recipe model a synthetic delta of its target shapes (random factors,
``random_delta``: the size depends on the shapes and the rank, not on the values) is encoded by
the real codec (safetensors + header + sha256) and measured; for 1.5B / 7B / 27B the bytes are
computed from shapes (U is bf16 ``[n_out, r]`` per target; the measured tiny header overhead is
added). Only the four target
kinds travel: embeddings, norms and biases are frozen (``native.freeze``), as in the RL
recipes. The bound printed beside each row is ``r/hidden + 2%`` of the full refit.

Time (CPU, medians of ``--repeats``, at each of ``--threads``): ``apply`` (``apply_delta_`` on
HF-layout weights: checks, ``V = grid(s·U)``, merge; with the :class:`ProjectionCache` an engine
keeps, so ``sign(A)`` is regenerated only when the projection changes and the commit is prepared only
when the delta's structure or the weights change), ``cold`` (the same without the cache: validated,
planned and prepared in full and ``sign(A)`` regenerated, as after ``logra.refresh``) and ``copy`` (``dst.copy_(src)`` for
every weight of the model, the engine side of a dense refit, in the same dtype) are timed side by
side in one loop, rotating which goes first, so all see the same machine load; ratios are of the
medians. The breakdown times the pieces of apply separately: the checks of a cached apply (header,
version chain, the kept commit's structure and weights), regenerating every engine
parameter's ``sign(A)``, ``V``, the rank-r GEMMs alone (``V·sign(A)`` into a cache-sized
workspace) and the whole merge kernel as apply runs it (fused GEMM-and-subtract where the BLAS check
allows, which streams every target weight once, as the copy streams every weight once).
``encode`` (delta -> bytes) and ``decode`` (bytes -> verified delta) are timed too.
``--baseline-rev REV`` adds ``apply_delta_`` as of git revision REV (its projection, factors and
apply modules, with the modules split out of them where REV has them) to the side-by-side loop, after checking that both give the same weights to within
rounding (the merge's definition changed with format 4, the stochastic-rounding noise with format 5),
for a before/after table. bf16 weights are timed with both merge roundings: to nearest, and
stochastic (the training default, ``optimizer.logra.rounding``).

    python benchmarks/sync_bytes.py [--repeats 7] [--threads 1,2] [--big-dtypes float32,bfloat16] [--baseline-rev REV]

``--device cuda`` (a GPU node, ~1 minute) times apply and copy on the accelerator instead, for the
>=100M model and the Qwen2.5-1.5B shape, each call closed by ``torch.cuda.synchronize()``; the
copy is then a device-to-device copy of every weight (the engine side of a refit whose tensors
already arrived). The weights are drawn on the device; the delta is decoded on the host, as an
engine receives it. The apply is timed twice: eagerly (the prepared commit's kernels launched one by
one) and replayed as a CUDA graph (``ProjectionCache(cuda_graphs=True)``, :mod:`megatron_logra.sync.graph`).

Results: the tables on stdout and in ``--out``. Without ``--out`` the documented CPU run (the default
``--ranks``, ``--timing-rank``, ``--big-dtypes`` and ``--threads``, at least the default ``--repeats``; more
repeats only narrow the medians and ``--baseline-rev`` only adds its before/after table) writes the committed
``benchmarks/results/sync_bytes.md``; any other CPU run writes ``runs/bench-sync-bytes/sync_bytes.md`` under
the working directory, so a smaller run never replaces the committed table. A ``--device`` run writes
``benchmarks/results/sync_bytes_DEVICE.md`` under the working directory (no committed table has that name).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_logra.argtypes import positive_int
from megatron_logra.bench.outputs import refuse_unwritable
from megatron_logra.bench.provenance import cpu_model
from megatron_logra.sync import apply_delta_, decode, encode
from megatron_logra.sync.apply import ProjectionCache, check_version
from megatron_logra.sync.merge import _merge_prepared_, chunk_elems, merge_row_chunks
from megatron_logra.sync.prepared import prepare, structure_key
from megatron_logra.sync.projection_cache import projection_matrices
from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.synthetic import DenseShape, random_delta

MODELS = {
    # name: (shape, note)
    "tiny (recipe)": (DenseShape(hidden=128, layers=4, heads=4, kv_heads=4, ffn=384, vocab=160), "untied"),
    "Qwen2.5-1.5B": (DenseShape(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True,
                                qkv_bias=True), "tied"),
    "Qwen2.5-7B": (DenseShape(hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, qkv_bias=True),
                   "untied"),
    "Gemma-3-27B": (DenseShape(hidden=5376, layers=62, heads=32, kv_heads=16, head_dim=128, ffn=21504, vocab=262208,
                               tied=True), "tied, head_dim 128"),
}
BIG = DenseShape(hidden=1024, layers=8, heads=16, kv_heads=4, ffn=4096, vocab=32000)

DEFAULT_RANKS, DEFAULT_TIMING_RANK, DEFAULT_REPEATS = "32,64", 32, 7
DEFAULT_BIG_DTYPES, DEFAULT_THREADS = "float32,bfloat16", "1,2"
COMMITTED = Path(__file__).resolve().parent / "results" / "sync_bytes.md"
"""The committed CPU tables: written by default only by the documented run (:func:`documented`)."""
OTHER_RUNS = Path("runs/bench-sync-bytes/sync_bytes.md")
""":data:`COMMITTED`'s stand-in (relative to the working directory) for a CPU run of other settings."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _side_by_side(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in one loop (rotating the order every round) after one warm-up round."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(repeats + 1):
        order = names[i % len(names):] + names[: i % len(names)]
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            if i:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    if device.type != "cuda":
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return run


def device_row(label: str, shape: DenseShape, rank: int, dtype: torch.dtype, rounding: str, repeats: int,
               device: torch.device) -> tuple[str, float]:
    """apply vs copy of every weight, side by side on ``device``; returns the table row and the ratio."""
    gen = torch.Generator(device).manual_seed(0)
    weights = {k: (torch.randn(*s, generator=gen, device=device) * 0.02).to(dtype) for k, s in shape.hf_shapes().items()}
    src = {k: v.clone() for k, v in weights.items()}
    decoded = decode(encode(random_delta(shape, rank, scale=1e-3, rounding=rounding)))

    def copy_all():
        for k, v in weights.items():
            v.copy_(src[k])

    cache, graphed = ProjectionCache(cuda_graphs=False), ProjectionCache(cuda_graphs=True)
    t = _side_by_side({"copy": _synced(copy_all, device),
                       "apply": _synced(lambda: apply_delta_(weights, decoded, decoded.base_version, cache=cache), device),
                       "graph": _synced(lambda: apply_delta_(weights, decoded, decoded.base_version, cache=graphed),
                                        device),
                       "cold": _synced(lambda: apply_delta_(weights, decoded, decoded.base_version), device)}, repeats)
    ratio, graph_ratio = t["apply"] / t["copy"], t["graph"] / t["copy"]
    captured = graphed._static is not None and any(g is not None for g in graphed._static.graphs.values())
    bytes_moved = sum(v.numel() * v.element_size() for v in weights.values())
    row = (f"| {label} | {_fmt_params(shape.num_params())} {str(dtype).removeprefix('torch.')} | "
           f"{_rounding_label(dtype, rounding)} | {rank} | {1e3 * t['apply']:.2f} | {1e3 * t['graph']:.2f}"
           f"{'' if captured else ' (not captured)'} | {1e3 * t['copy']:.2f} ({2 * bytes_moved / t['copy'] / 1e9:.0f} GB/s) | "
           f"**{ratio:.2f}x** | **{graph_ratio:.2f}x** | {t['cold'] / t['copy']:.2f}x | "
           f"{'yes' if min(ratio, graph_ratio) <= 1.5 else 'NO'} |")
    return row, min(ratio, graph_ratio)


def _dtype_roundings(dtypes: list[torch.dtype]) -> list[tuple[torch.dtype, str]]:
    """Each dtype with the merge roundings that differ for it: bf16 weights are timed rounded to nearest and
    stochastically (the training default, ``optimizer.logra.rounding=stochastic``)."""
    return [(d, r) for d in dtypes for r in (("nearest", "stochastic") if d == torch.bfloat16 else ("nearest",))]


def _rounding_label(dtype: torch.dtype, rounding: str) -> str:
    return rounding if dtype == torch.bfloat16 else "-"


DEVICE_MODELS = {"big": ("hidden 1024 x 8, ffn 4096, vocab 32000", BIG), "1.5b": ("Qwen2.5-1.5B", MODELS["Qwen2.5-1.5B"][0])}


def device_table(device: torch.device, rank: int, dtypes: list[torch.dtype], repeats: int,
                 models: list[str]) -> list[str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"## Engine-side time on {name} (median of {repeats}; apply and copy side by side, synchronized)", "",
             "| model | params | bf16 rounding | rank | apply ms | CUDA-graph apply ms | copy all ms (copy bandwidth) | "
             "apply / copy | CUDA-graph apply / copy | cold apply / copy | <= 1.5x |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for label, shape in (DEVICE_MODELS[m] for m in models):
        for dtype, rounding in _dtype_roundings(dtypes):
            row, _ = device_row(label, shape, rank, dtype, rounding, repeats, device)
            lines.append(row)
            print(row, flush=True)
    return lines


def bytes_table(ranks: list[int]) -> list[str]:
    tiny_shape = MODELS["tiny (recipe)"][0]
    overhead = {}
    for r in ranks:
        delta = random_delta(tiny_shape, r)
        overhead[r] = len(encode(delta)) - delta.payload_bytes()
    lines = [
        "| model | params | rank | sketch delta | full bf16 refit | delta / full | bound r/hidden + 2% | within |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, (shape, note) in MODELS.items():
        full = 2 * shape.num_params()
        for r in ranks:
            if name.startswith("tiny"):
                delta_bytes = len(encode(random_delta(shape, r)))  # measured
                how = "measured"
            else:
                delta_bytes = 2 * r * sum(o for _, o, _ in shape.targets()) + overhead[r] * shape.layers // tiny_shape.layers
                how = "from shapes"
            bound = r / shape.hidden + 0.02
            ratio = delta_bytes / full
            lines.append(
                f"| {name} ({note}) | {_fmt_params(shape.num_params())} | {r} | {_fmt_bytes(delta_bytes)} ({how}) | "
                f"{_fmt_bytes(full)} | {100 * ratio:.2f}% | {100 * bound:.2f}% | {'yes' if ratio <= bound else 'NO'} |"
            )
    return lines


def _merge_pieces(weights: dict[str, torch.Tensor], delta: SketchDelta) -> dict[str, Callable[[], object]]:
    """The pieces of ``apply_delta_`` (HF layout), each as a function timing only that piece."""
    plan = plan_for(delta, "hf")
    prepared = prepare(delta, plan.factors, weights, structure_key(delta, "hf", 1, 0, None))
    ws = [weights[p] for p in prepared.params]
    V32, noises = prepared.factors(delta), prepared.noises(delta)
    elems = chunk_elems(torch.device("cpu"))
    gemm_buf = torch.empty(max(max(b - a for a, b in merge_row_chunks(w.shape[0], w.shape[1], elems)) * w.shape[1]
                               for w in ws))

    def gemm():  # the rank-r GEMMs alone, into a cache-sized workspace
        for w, V, m in zip(ws, V32, prepared.merges):
            n_in = w.shape[1]
            for a, b in merge_row_chunks(w.shape[0], n_in, elems):
                torch.mm(V[a:b], m.matrix, out=gemm_buf[: (b - a) * n_in].view(b - a, n_in))

    def merge():  # the commit kernel apply_delta_ runs (fused where the BLAS check allows it)
        for w, V, m, noise in zip(ws, V32, prepared.merges, noises):
            prod_buf, tmp_buf, noise_buf = prepared.workspaces[w.device]
            _merge_prepared_(w, V, m.matrix, delta.decay, prod_buf, tmp_buf, m.elems, noise, noise_buf, m.fused)

    key = structure_key(delta, "hf", 1, 0, None)

    def checks():  # what an apply with a kept prepared commit checks before its arithmetic
        delta.check_structure()
        check_version(delta, delta.base_version)
        structure_key(delta, "hf", 1, 0, None) == key and prepared.weights(weights)

    return {"checks": checks,
            "regen": lambda: projection_matrices(delta, plan.factors, weights),
            "scale": lambda: prepared.factors(delta), "gemm": gemm, "merge": merge}


_BASELINE_FILES = {  # module name in the baseline package -> path; imports rewritten to the baseline copies
    "baseline_projection": "megatron_logra/sketch/random_projection.py",
    "baseline_factors": "megatron_logra/sync/factors.py",
    "baseline_apply": "megatron_logra/sync/apply.py",
    # split out of the files above: a revision from before the split has their code in those files
    "baseline_entry_hash": "megatron_logra/sketch/entry_hash.py",
    "baseline_delta_checks": "megatron_logra/sync/delta_checks.py",
    "baseline_staged_delta": "megatron_logra/sync/staged_delta.py",
}
_OPTIONAL_BASELINE_FILES = frozenset({"baseline_entry_hash", "baseline_delta_checks", "baseline_staged_delta"})
"""Modules of :data:`_BASELINE_FILES` a revision may lack: skipped once the required files proved it a revision."""


def _baseline_rewrites() -> list[tuple[re.Pattern[str], str]]:
    """``(pattern of a dotted module name, baseline module name)`` for every file of :data:`_BASELINE_FILES`, the
    longest dotted name first, each matched as a whole name (so no name is rewritten inside a longer one)."""
    dotted = {path.removesuffix(".py").replace("/", "."): mod for mod, path in _BASELINE_FILES.items()}
    return [(re.compile(r"(?<![\w.])" + re.escape(name) + r"(?![\w])"), dotted[name])
            for name in sorted(dotted, key=len, reverse=True)]


class BaselineError(Exception):
    """``--baseline-rev`` cannot be loaded: the message says why (git's own words where git refused)."""


def _load_baseline(rev: str) -> Callable[[], Callable[..., int]]:
    """A factory of ``apply_delta_`` as of git revision ``rev`` (projection, factors and apply from that commit, with
    the modules split out of them where ``rev`` has them: :data:`_BASELINE_FILES`; the rest current); each call
    gives one with a fresh projection cache where that revision has one, so it is timed as an engine runs it, like
    the current apply.

    Raises :class:`BaselineError` (one line, with git's message) when ``rev`` is not a revision of this
    checkout, lacks one of the required files (not those of :data:`_OPTIONAL_BASELINE_FILES`), or its modules
    do not import; the scratch directory is then removed
    (otherwise when the process exits)."""
    import atexit
    import importlib
    import shutil
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    tmp = Path(tempfile.mkdtemp(prefix="sync_baseline_"))
    try:
        # the required files first: they prove ``rev`` a revision of this checkout, so that an optional file it
        # lacks can be skipped (its code is then in the required files, as before the split)
        for mod, path in sorted(_BASELINE_FILES.items(), key=lambda item: item[0] in _OPTIONAL_BASELINE_FILES):
            if mod in _OPTIONAL_BASELINE_FILES and subprocess.run(
                    ["git", "-C", str(root), "cat-file", "-e", f"{rev}:{path}"], capture_output=True).returncode:
                continue
            try:
                text = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{path}"], check=True,
                                      capture_output=True, text=True).stdout
            except subprocess.CalledProcessError as exc:
                why = " ".join((exc.stderr or "").split()) or f"git show exited {exc.returncode}"
                raise BaselineError(f"cannot read {path} at {rev!r}: {why}") from None
            except OSError as exc:
                raise BaselineError(f"cannot run git: {exc}") from None
            for pattern, baseline_mod in _baseline_rewrites():
                text = pattern.sub(baseline_mod, text)
            (tmp / f"{mod}.py").write_text(text)
        for mod in _BASELINE_FILES:  # an earlier load's modules (another revision) must not stand in for these
            sys.modules.pop(mod, None)
        importlib.invalidate_caches()
        sys.path.insert(0, str(tmp))
        try:
            module = importlib.import_module("baseline_apply")
            fn = module.apply_delta_
        except (ImportError, AttributeError) as exc:
            sys.path.remove(str(tmp))
            for mod in _BASELINE_FILES:
                sys.modules.pop(mod, None)
            raise BaselineError(f"the modules at {rev!r} do not provide apply_delta_: {type(exc).__name__}: {exc}") \
                from None
    except BaselineError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    cache_cls = getattr(module, "ProjectionCache", None)
    if cache_cls is None or "cache" not in inspect.signature(fn).parameters:
        return lambda: fn

    def with_cache() -> Callable[..., int]:  # as the current apply is timed: with the engine's projection cache
        cache = cache_cls()
        return lambda weights, delta, version: fn(weights, delta, version, cache=cache)

    return with_cache


def time_rows(label: str, shape: DenseShape, rank: int, dtype: torch.dtype, rounding: str, repeats: int,
              threads: int, baseline_factory: Optional[Callable[[], Callable[..., int]]] = None) -> tuple[str, dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weights = {k: (torch.randn(*s, generator=gen) * 0.02).to(dtype) for k, s in shape.hf_shapes().items()}
    src = {k: torch.empty_like(v).copy_(v) for k, v in weights.items()}
    delta = random_delta(shape, rank, scale=1e-3, rounding=rounding)
    data = encode(delta)
    decoded = decode(data)

    def copy_all():
        for k, v in weights.items():
            v.copy_(src[k])

    cache = ProjectionCache()  # as an engine keeps it: sign(A) regenerated when the projection changes
    fns = {"copy": copy_all, "apply": lambda: apply_delta_(weights, decoded, decoded.base_version, cache=cache),
           "cold": lambda: apply_delta_(weights, decoded, decoded.base_version)}
    baseline = baseline_factory() if baseline_factory is not None else None
    if baseline is not None:
        check = {k: v.clone() for k, v in weights.items()}
        baseline(check, decoded, decoded.base_version)
        apply_delta_(weights, decoded, decoded.base_version)
        worst = max(float((check[k].double() - weights[k].double()).abs().max()
                          / (weights[k].double().abs().max() + 1e-30)) for k in weights)
        if worst > 4 * torch.finfo(dtype).eps:  # the merge's definition may have changed: not beyond rounding
            raise SystemExit(f"the baseline and the current apply differ beyond rounding ({worst:.2e} of max|W|)")
        del check
        fns["baseline"] = lambda: baseline(weights, decoded, decoded.base_version)
    main = _side_by_side(fns, repeats)
    parts = _side_by_side(_merge_pieces(weights, decoded), repeats)
    t_encode = _median_time(lambda: encode(delta), repeats)
    t_decode = _median_time(lambda: decode(data), repeats)
    n = shape.num_params()
    flops = 2 * rank * shape.target_params()
    ms = {k: 1e3 * v for k, v in {**main, **parts}.items()}
    row = (f"| {label} | {_fmt_params(n)} {str(dtype).removeprefix('torch.')} | {_rounding_label(dtype, rounding)} | "
           f"{rank} | {threads} | "
           f"{_fmt_bytes(len(data))} | {1e3 * t_encode:.1f} | {1e3 * t_decode:.1f} | {ms['apply']:.1f} | "
           f"{ms['copy']:.1f} | **{main['apply'] / main['copy']:.2f}x** | {main['cold'] / main['copy']:.2f}x | "
           f"{ms['checks']:.1f} | {ms['regen']:.1f} | {ms['scale']:.1f} | "
           f"{ms['gemm']:.1f} ({flops / parts['gemm'] / 1e9:.0f} GFLOP/s) | {ms['merge']:.1f} | "
           f"{parts['gemm'] / main['copy']:.2f}x | {parts['merge'] / main['copy']:.2f}x |")
    return row, {**main, **parts, "flops": flops, "targets": shape.target_params(), "params": n, "threads": threads,
                 "dtype": dtype, "rounding": _rounding_label(dtype, rounding), "label": label, "factors": len(plan_for(decoded, "hf").factors),
                 "layers_A": len(decoded.targets)}


def _explain(stats: dict, rank: int) -> str:
    """One paragraph saying where the time of one row goes."""
    ratio = stats["apply"] / stats["copy"]
    other = stats["apply"] - stats["checks"] - stats["scale"] - stats["merge"]
    dt = str(stats["dtype"]).removeprefix("torch.")
    if stats["rounding"] != "-":
        dt += f" ({stats['rounding']} rounding)"
    text = (
        f"- {stats['label']}, {dt}, {stats['threads']} thread(s): apply {1e3 * stats['apply']:.1f} ms = "
        f"{ratio:.2f}x the copy ({1e3 * stats['copy']:.1f} ms); without the engine's projection cache "
        f"{stats['cold'] / stats['copy']:.2f}x (regenerating sign(A) for {stats['factors']} engine parameters, one A "
        f"per layer and width: {1e3 * stats['regen']:.1f} ms). The merge {1e3 * stats['merge']:.1f} ms "
        f"({stats['merge'] / stats['copy']:.2f}x the copy) against rank-{rank} GEMMs alone of "
        f"{1e3 * stats['gemm']:.1f} ms ({2 * rank} flops per target weight, {stats['flops'] / 1e9:.1f} GFLOP at "
        f"{stats['flops'] / stats['gemm'] / 1e9:.0f} GFLOP/s)"
        + (": the fused kernel streams each target weight through the GEMM once"
           if dt == "float32" else ", plus the fp32 scratch of the bf16 weights (convert, GEMM into it, round back)"
           + ("; stochastic rounding adds three passes over the scratch (noise, add, cut)"
              if stats["rounding"] == "stochastic" else ""))
        + f"; V = grid(s·U) {1e3 * stats['scale']:.1f} ms, checks (header, version chain, the kept commit's "
        f"structure and weights) {1e3 * stats['checks']:.1f} ms, the rest (noise, dispatch) {1e3 * max(other, 0):.1f} ms."
    )
    if stats["params"] < 1e7:
        text += " With ~1M parameters the fixed per-tensor work (a few dozen small ops per tensor) dominates."
    return text


def positive_ints(text: str) -> list[int]:
    """A comma list of positive integers (``--ranks``, ``--threads``)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive integers")
    return values


def float_dtypes(text: str) -> list[torch.dtype]:
    """``--big-dtypes``: a comma list of torch floating-point dtype names."""
    out = []
    for name in text.split(","):
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise argparse.ArgumentTypeError(
                f"{name.strip()!r} is not a torch floating-point dtype: expected a comma list such as float32,bfloat16")
        out.append(dtype)
    return out


def device_models(text: str) -> list[str]:
    """``--device-models``: a comma list of :data:`DEVICE_MODELS` keys."""
    models = [m.strip() for m in text.split(",")]
    unknown = sorted(set(models) - set(DEVICE_MODELS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; expected a comma list of {sorted(DEVICE_MODELS)}")
    return models


def torch_device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (such as cpu, cuda or cuda:1)") from None


def documented(args: argparse.Namespace) -> bool:
    """Whether the CPU run of ``args`` is the documented one, whose tables are committed: the default ranks,
    timing rank, weight dtypes and thread counts, with at least the default number of repeats."""
    return (args.ranks == positive_ints(DEFAULT_RANKS) and args.timing_rank == DEFAULT_TIMING_RANK
            and args.big_dtypes == float_dtypes(DEFAULT_BIG_DTYPES) and args.threads == positive_ints(DEFAULT_THREADS)
            and args.repeats >= DEFAULT_REPEATS)


def default_out(args: argparse.Namespace) -> Path:
    """The report file of a run without ``--out`` (see the module docstring)."""
    if args.device:
        return Path(f"benchmarks/results/sync_bytes_{args.device.type}.md")
    return COMMITTED if documented(args) else OTHER_RUNS


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=positive_ints, default=DEFAULT_RANKS,
                   help=f"sketch ranks of the bytes table (comma separated; default {DEFAULT_RANKS})")
    p.add_argument("--timing-rank", type=positive_int, default=DEFAULT_TIMING_RANK,
                   help=f"sketch rank of the timed deltas (default {DEFAULT_TIMING_RANK})")
    p.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS,
                   help=f"timed repeats of each measurement; the medians are reported (default {DEFAULT_REPEATS})")
    p.add_argument("--big-dtypes", type=float_dtypes, default=DEFAULT_BIG_DTYPES,
                   help=f"weight dtypes of the >=100M model (default {DEFAULT_BIG_DTYPES})")
    p.add_argument("--threads", type=positive_ints, default=DEFAULT_THREADS,
                   help=f"thread counts (comma separated; default {DEFAULT_THREADS}); both sides use the same")
    p.add_argument("--baseline-rev", default=None,
                   help="also time apply_delta_ as of this git revision, side by side (and check equal weights)")
    p.add_argument("--device", type=torch_device, default=None,
                   help="time apply vs copy on this device (e.g. cuda) instead of the CPU tables")
    p.add_argument("--device-models", type=device_models, default="big,1.5b",
                   help=f"models of --device: any of {sorted(DEVICE_MODELS)}")
    p.add_argument("--out", type=Path, default=None,
                   help="report file (default: benchmarks/results/sync_bytes.md for the documented CPU run, any other "
                        f"CPU run {OTHER_RUNS}; with --device benchmarks/results/sync_bytes_DEVICE.md under the working "
                        "directory, so a GPU run never replaces the CPU tables)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.out is None:
        args.out = default_out(args)
    refuse_unwritable(p, "--out", args.out)
    timed = ([DEVICE_MODELS[m] for m in args.device_models] if args.device
             else [("tiny (recipe)", MODELS["tiny (recipe)"][0]), ("hidden 1024 x 8", BIG)])
    narrowest, label = min((min(n_in for _, _, n_in in shape.targets()), label) for label, shape in timed)
    if args.timing_rank > narrowest:
        p.error(f"argument --timing-rank: {args.timing_rank} is more than {narrowest}, the smallest target input width "
                f"of the timed models ({label}); a sketch rank is at most a target's input width")
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    if args.device:
        device = args.device
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error("argument --device: no CUDA device is visible")
        lines = device_table(device, args.timing_rank, args.big_dtypes, args.repeats, args.device_models)
        text = "\n".join([f"Command: `python benchmarks/sync_bytes.py {argv_text}`", ""] + lines) + "\n"
        print(text)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        return 0
    try:
        baseline = _load_baseline(args.baseline_rev) if args.baseline_rev else None
    except BaselineError as exc:
        p.error(f"argument --baseline-rev: {exc}")
    ranks, threads = args.ranks, args.threads
    torch.set_num_threads(threads[0])
    r = args.timing_rank
    out: list[str] = ["## Bytes per sync", ""]
    out += bytes_table(ranks)
    out += ["", f"## Engine-side time (CPU, median of {args.repeats}; apply and copy side by side)", "",
            "| model | params | bf16 rounding | rank | threads | delta bytes | encode ms | decode ms | apply ms | copy all ms | "
            "apply / copy | cold apply / copy | checks ms | sign(A) ms | V ms | GEMM ms | merge ms | GEMM / copy | "
            "merge / copy |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    runs = [("tiny (recipe)", MODELS["tiny (recipe)"][0], torch.float32, "nearest")]
    runs += [("hidden 1024 x 8, ffn 4096, vocab 32000", BIG, d, rd) for d, rd in _dtype_roundings(args.big_dtypes)]
    notes: list[str] = []
    versus: list[str] = []
    for label, shape, dtype, rounding in runs:
        for t in threads:
            row, stats = time_rows(label, shape, r, dtype, rounding, args.repeats, t, baseline)
            out.append(row)
            if baseline is not None:
                versus.append(f"| {label} | {str(dtype).removeprefix('torch.')} | {stats['rounding']} | {t} | {1e3 * stats['copy']:.1f} | "
                              f"{1e3 * stats['baseline']:.1f} | {stats['baseline'] / stats['copy']:.2f}x | "
                              f"{1e3 * stats['apply']:.1f} | {stats['apply'] / stats['copy']:.2f}x |")
            notes.append(_explain(stats, r))
            print(row, flush=True)
    if versus:
        out += ["", f"Before / after (apply at `{args.baseline_rev}` and now, side by side with the copy):", "",
                "| model | weights | bf16 rounding | threads | copy ms | apply before ms | before / copy | apply now ms | "
                "now / copy |",
                "|---|---|---|---:|---:|---:|---:|---:|---:|"] + versus
    out += ["", "Where the time goes:", ""] + notes + ["", _BOUND_NOTE.format(r=r, flops=2 * r)]
    out += ["", f"Load average at the end: {_load():.1f} (other processes share the cores: compare ratios, not times)."]
    text = "\n".join(out)
    print(text)
    cmd = "python benchmarks/sync_bytes.py " + argv_text
    header = ["# Sketch-delta sync: bytes per sync and engine-side time", "", f"Command: `{cmd.strip()}`", "",
              f"Machine: {_machine()}.", "",
              "Shapes: tiny = the `tiny` RL recipe (4 heads, MHA); Qwen2.5-1.5B/7B from their configs "
              "(qkv biases, frozen); 27B = Gemma-3-27B (hidden 5376, 62 layers, 32 heads, 16 kv heads, head_dim 128, "
              "ffn 21504, vocab 262208, tied). Only the four target kinds travel (embeddings, norms, biases frozen). "
              "Full refit = every parameter in bf16.", "", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(header) + text + "\n")
    return 0


_BOUND_NOTE = (
    "What bounds apply on a CPU: the merge subtracts ``V·sign(A)`` exactly (that is what keeps trainer and engine "
    "bitwise equal), a rank-{r} GEMM of {flops} flops per target weight. Since the product is exact, one BLAS call "
    "(``W.addmm_(V, sign(A), alpha=-1)``, where the start-up check of ``sync/fused.py`` shows the BLAS rounds once) "
    "does the GEMM and the subtraction while streaming each target weight once, as the copy streams every weight "
    "once: the merge then costs about the GEMM's compute time, which on a few cores is of the order of the copy's "
    "memory time. ``apply`` is what an engine pays per sync (it keeps sign(A) while the projection is unchanged, "
    "i.e. without ``logra.refresh``); ``cold`` regenerates it, as after a refresh. One thread halves the GEMM's speed "
    "but not the copy's bandwidth, so the ratio is higher there; bf16 weights halve the copy's bytes but not the "
    "GEMM, and go through an fp32 scratch, so their ratio is higher still. On a GPU the rank-{r} GEMM is far "
    "below the memory time (``--device cuda``)."
)


def _machine() -> str:
    import os

    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, load average {_load():.1f} at the start"


def _load() -> float:
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
