#!/usr/bin/env python
"""Optimizer memory and step time: dense AdamW vs LoGRA (fp32 masters) vs LoGRA (bf16 only).

For megatron-core GPTs of several sizes (bf16 weights, rank r = hidden/16, one micro-batch
of 2 x 512 tokens, one process) this measures, side by side in one run:

* persistent bytes per *target* parameter (``linear_qkv/proj/fc1/fc2``), summed from the
  real objects that live across steps (weights, fp32 main grads, masters, Adam moments,
  sketches, row moments), next to the formula value (18; 2 + 4 + (4r + 4)/n_in; 2 + (4r + 4)/n_in);
* peak memory of one full train step (forward, backward, prepare, apply), two ways:
  (1) exact live-tensor accounting: a ``TorchDispatchMode`` registers every storage that an
  op returns (once, by storage) plus every tensor alive when the step starts, and drops it
  when ``weakref.finalize`` on the storage fires; (2) the peak RSS (``ru_maxrss``, reset through
  ``/proc/self/clear_refs`` once the model is built) of the process that ran the configuration,
  absolute and above the RSS measured before the model was built;
* step time: median over a few full steps, after a short warm-up step and the tracked step.

Every configuration runs in its own child process (``--child``, so its peak RSS is its own;
fresh children per size, or one per configuration for all sizes with ``--quick``).
The three children of one size stay alive together and the parent commands their steps
round-robin (rotating the order each round), so slow drifts of the machine's load hit all
three alike and the time ratios are taken side by side.

    python benchmarks/optimizer_memory.py            # full run (~10-15 min on 2 cores)
    python benchmarks/optimizer_memory.py --quick    # smaller sizes, fewer steps, reused children (~1.5 min)

Results: a table on stdout, plus ``STEM.md`` and ``STEM.json`` of ``--out STEM``. Without ``--out`` the
documented runs write the committed ``benchmarks/results/optimizer_memory{,_quick}.{md,json}``: the full run
(the default ``--sizes``, ``--seq``, ``--micro-batch``, ``--vocab``, ``--threads`` and ``--reuse-processes``)
and ``--quick`` (the same with its own sizes and reused children), each with at least its default number of
``--steps`` (more timed steps only narrow the step-time medians). Any other run writes
``runs/bench-optimizer-memory/optimizer_memory{,_quick}.{md,json}`` under the working directory, so a smaller
run never replaces a committed table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_logra.memory.measure import (  # noqa: E402
    LiveTensorTracker,
    maxrss_bytes as _maxrss_bytes,
    reset_peak_rss as _reset_peak_rss,
    rss_bytes as _rss_bytes,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from megatron_logra.bench.outputs import refuse_unwritable  # noqa: E402
from megatron_logra.bench.provenance import cpu_model  # noqa: E402
from megatron_logra.bench.optimizer_memory_report import (  # noqa: E402
    MiB, NOTES, OPTIMIZERS, detail_lines, markdown, print_table, summarize, verdict_lines, verdicts,
)

FULL_SIZES = [(256, 2), (512, 1), (1024, 1)]
QUICK_SIZES = [(64, 1), (128, 1), (256, 1)]
DEFAULT_SEQ, DEFAULT_MICRO_BATCH, DEFAULT_VOCAB, DEFAULT_THREADS = 512, 2, 1024, 2
FULL_STEPS, QUICK_STEPS = 3, 2
COMMITTED = HERE / "results"
"""Directory of the committed tables: written by default only by the documented runs (:func:`documented`)."""
OTHER_RUNS = Path("runs/bench-optimizer-memory")
""":data:`COMMITTED`'s stand-in (relative to the working directory) for a run of other settings."""



# ======================================================================== utilities (both sides)
def ffn_size(hidden: int) -> int:
    """Llama-style SwiGLU width: 8/3·hidden rounded down to a multiple of 64."""
    return max(64, (8 * hidden // 3) // 64 * 64)


# ======================================================================== child: one configuration
class _NullTracker:
    def set_phase(self, phase: str) -> None:
        pass


class Child:
    """One optimizer configuration, driven over stdin/stdout: ``build H L``, then steps and a report.

    Normally a child builds one size and exits (fresh process, clean RSS). ``--quick`` reuses
    the children across sizes (``free`` then ``build``) to save the imports; the RSS baseline
    of a size is then the RSS after the previous size was freed.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import warnings

        warnings.filterwarnings("ignore")
        import torch

        torch.set_num_threads(args.threads)
        from megatron_logra.parallel import ParallelConfig, initialize_parallel
        from megatron_logra.train.step import forward_backward

        self.torch = torch
        self.args = args
        self.forward_backward = forward_backward
        self.kind = args.opt
        self.groups = initialize_parallel(ParallelConfig(), seed=1)
        self.model = self.opt = None

    def cmd_free(self) -> dict:
        import gc

        self.model = self.opt = self.batch = self.warm_batch = None
        self.target_params = []
        gc.collect()
        return {"rss_bytes": _rss_bytes()}

    def cmd_build(self, hidden: str, layers: str) -> dict:
        import gc

        torch, args = self.torch, self.args
        from megatron_logra.models.gpt import ModelConfig, build_gpt
        from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
        from megatron_logra.sketch.capture import DEFAULT_TARGETS
        from megatron_logra.train.step import Batch

        if self.model is not None:
            self.cmd_free()
        gc.collect()
        self.baseline_rss = _rss_bytes()
        _reset_peak_rss()  # a reused process: forget the previous size's peak
        h, L = int(hidden), int(layers)
        self.hidden, self.layers = h, L
        self.rank = max(1, h // 16)
        self.mcfg = ModelConfig(
            num_layers=L, hidden_size=h, num_attention_heads=max(1, h // 64), ffn_hidden_size=ffn_size(h),
            vocab_size=args.vocab, seq_length=args.seq, params_dtype="bfloat16", swiglu=True,
        )
        self.model = build_gpt(self.mcfg, self.groups, seed=1)
        if self.kind == "adam":
            ocfg = OptimizerConfig(name="adam", native=NativeConfig(lr=1e-4))
        else:
            masters = "fp32" if self.kind == "logra_fp32" else "none"
            ocfg = OptimizerConfig(
                name="logra", logra=LograConfig(rank=self.rank, masters=masters, lr=1e-4), native=NativeConfig(lr=1e-4)
            )
        self.opt = build_optimizer(self.model, ocfg, self.groups)
        self.build_rss = _rss_bytes()
        # the peak RSS from here on belongs to the steps, not to imports or the model build
        self.build_peak_rss = _maxrss_bytes()
        self.rss_reset = _reset_peak_rss()

        # the target linears (the same modules LoGRA targets, looked up by leaf name)
        self.target_params: list[tuple[str, Any]] = []
        for name, mod in self.model.named_modules():
            if name.split(".")[-1] in DEFAULT_TARGETS:
                self.target_params.append((name, mod.weight))

        gen = torch.Generator().manual_seed(1234)

        def make_batch(b: int, s: int):
            tokens = torch.randint(0, args.vocab, (b, s), generator=gen)
            labels = torch.roll(tokens, -1, dims=1)
            return Batch(tokens, labels, torch.ones(b, s, dtype=torch.float32),
                         torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous())

        self.batch = make_batch(args.micro_batch, args.seq)
        self.warm_batch = make_batch(args.micro_batch, min(args.seq, 64))
        self.projection_cache_bytes = 0
        self.losses: list[float] = []
        return {"baseline_rss_bytes": self.baseline_rss, "build_rss_bytes": self.build_rss}

    # -- one full train step
    def _step(self, batch, tracker=None) -> dict:
        torch = self.torch
        tr = tracker or _NullTracker()
        c0, t0 = time.process_time(), time.perf_counter()
        tr.set_phase("zero_grad")
        self.opt.zero_grad()
        tr.set_phase("fwd_bwd")
        res = self.forward_backward(self.model, [batch], self.groups)
        t1 = time.perf_counter()
        tr.set_phase("prepare")
        update = self.opt.prepare(num_tokens=res.num_tokens)
        t2 = time.perf_counter()
        cache = getattr(getattr(self.opt, "sketches", None), "_cache", None)
        if cache:
            self.projection_cache_bytes = sum(v.numel() * v.element_size() for v in cache.values())
        tr.set_phase("apply")
        self.opt.apply(update)
        t3, c3 = time.perf_counter(), time.process_time()
        tr.set_phase("end")
        if update.skipped:
            raise RuntimeError(f"{self.kind}: step skipped ({update.reason})")
        if not (res.loss == res.loss) or res.loss in (float("inf"), float("-inf")):
            raise RuntimeError(f"{self.kind}: non-finite loss {res.loss}")
        self.losses.append(res.loss)
        del torch
        return {"wall_s": t3 - t0, "cpu_s": c3 - c0, "fwd_bwd_s": t1 - t0, "prepare_s": t2 - t1,
                "apply_s": t3 - t2, "loss": res.loss}

    def cmd_warmup(self) -> dict:
        return self._step(self.warm_batch)

    def cmd_track(self) -> dict:
        import gc

        gc.collect()
        tracker = LiveTensorTracker()
        with tracker:
            out = self._step(self.batch, tracker)
        gc.collect()
        out.update(
            live_start_bytes=tracker.start_bytes, live_peak_bytes=tracker.peak, peak_phase=tracker.peak_phase,
            phase_peaks=tracker.phase_peaks, live_end_bytes=tracker.current, num_ops=tracker.num_ops,
            peak_breakdown=dict(sorted(tracker.peak_breakdown.items(), key=lambda kv: -kv[1])[:12]),
        )
        return out

    def cmd_step(self) -> dict:
        return self._step(self.batch)

    # -- persistent accounting from the real objects
    def _nbytes(self, t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    def cmd_report(self) -> dict:
        torch = self.torch
        per_target: dict[str, int] = {}
        target_numel = sum(p.numel() for _, p in self.target_params)
        rows = sum(p.shape[0] for _, p in self.target_params)
        target_ids = {id(p) for _, p in self.target_params}

        def add(key: str, n: int) -> None:
            per_target[key] = per_target.get(key, 0) + n

        opt = self.opt
        native = opt.native
        for _, p in self.target_params:
            add("weight", self._nbytes(p))
            add("grad", self._nbytes(p.grad) + self._nbytes(getattr(p, "main_grad", None)))
        if self.kind == "adam":
            index = {id(p): i for i, p in enumerate(native.params)}
            for _, p in self.target_params:
                master = native.masters[index[id(p)]]
                if master is not p:
                    add("master", self._nbytes(master))
                state = native.inner.state.get(master, {})
                add("moments", sum(self._nbytes(v) for v in state.values() if isinstance(v, torch.Tensor)))
        else:
            for t in opt.targets:
                assert id(t.weight) in target_ids, f"LoGRA target {t.module_name} is not a benchmark target"
                add("master", self._nbytes(opt.masters.get(t.key)))
                add("sketch", self._nbytes(t.sketch))
                add("row_moments", self._nbytes(opt.row_moments[t.key]))
            assert len(opt.targets) == len(self.target_params)
        measured = sum(per_target.values())

        # formula, from shapes only
        if self.kind == "adam":
            formula = 18.0
        else:
            base = 2 + (4 if self.kind == "logra_fp32" else 0)
            formula = base + rows * (4 * self.rank + 4) / target_numel

        # whole model: unique storages of parameters, buffers and optimizer state
        seen: set[int] = set()
        whole = 0

        def count(t) -> None:
            nonlocal whole
            if t is None or not isinstance(t, torch.Tensor):
                return
            st = t.untyped_storage()
            if id(st) in seen:
                return
            seen.add(id(st))
            whole += st.nbytes()

        for p in self.model.parameters():
            count(p)
            count(p.grad)
            count(getattr(p, "main_grad", None))
        for b in self.model.buffers():
            count(b)
        for m in native.masters:
            count(m)
        if native.inner is not None:
            for st in native.inner.state.values():
                for v in st.values():
                    count(v)
        if self.kind != "adam":
            count(opt.sketches.flat)
            for v in opt.row_moments.values():
                count(v)
            for v in opt.masters.values():
                count(v)
        model_numel = sum(p.numel() for p in self.model.parameters())
        claimed = opt.persistent_bytes()
        # the same categories measured from the objects, to check persistent_bytes()
        native_measured = 0
        for p, m in zip(native.params, native.masters):
            native_measured += self._nbytes(getattr(p, "main_grad", None)) + self._nbytes(p.grad)
            if m is not p:
                native_measured += self._nbytes(m)
            st = native.inner.state.get(m, {}) if native.inner is not None else {}
            native_measured += sum(self._nbytes(v) for v in st.values() if isinstance(v, torch.Tensor))
        if self.kind == "adam":
            measured_claims = {"grads+masters+moments": native_measured}
        else:
            measured_claims = {
                "sketches": self._nbytes(opt.sketches.flat),
                "row_moments": sum(self._nbytes(v) for v in opt.row_moments.values()),
                "masters": sum(self._nbytes(v) for v in opt.masters.values()),
                "native": native_measured,
            }
        return {
            "kind": self.kind,
            "hidden": self.hidden,
            "layers": self.layers,
            "ffn": self.mcfg.ffn_hidden_size,
            "rank": self.rank,
            "model_params": model_numel,
            "target_params": target_numel,
            "target_rows": rows,
            "persistent_target_bytes": per_target,
            "persistent_target_B_per_param": measured / target_numel,
            "persistent_target_formula_B_per_param": formula,
            "persistent_model_bytes": whole,
            "persistent_model_B_per_param": whole / model_numel,
            "opt_persistent_bytes_claimed": claimed,
            "opt_persistent_bytes_measured": measured_claims,
            "native_params": sum(p.numel() for p in native.params),
            "projection_cache_bytes": self.projection_cache_bytes,
            "baseline_rss_bytes": self.baseline_rss,
            "build_rss_bytes": self.build_rss,
            "build_peak_rss_bytes": self.build_peak_rss,
            "rss_reset_after_build": self.rss_reset,
            "peak_rss_bytes": _maxrss_bytes(),
            "losses": self.losses,
        }


def child_main(args: argparse.Namespace) -> None:
    # stdout is the protocol channel; everything else printed goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        child = Child(args)
        send({"ok": True, "event": "ready"})
        for line in sys.stdin:
            cmd, *cmd_args = line.split()
            if cmd == "exit":
                break
            send({"ok": True, "cmd": cmd, "result": getattr(child, f"cmd_{cmd}")(*cmd_args)})
    except Exception as exc:  # report to the parent, then fail
        import traceback

        traceback.print_exc()
        send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1)


# ======================================================================== parent
class ChildFailed(RuntimeError):
    """A child reported an error or died: ``str(exc)`` is one line (what failed), ``log`` the last
    lines of the child's stderr (its traceback)."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log

    def save_log(self) -> Path:
        """Write :attr:`log` to a temporary file (kept) and return its path."""
        with tempfile.NamedTemporaryFile("w", prefix="optimizer_memory-child-", suffix=".log", delete=False) as fh:
            fh.write(self.log)
        return Path(fh.name)


@dataclass
class ChildProc:
    kind: str
    proc: subprocess.Popen
    log: Any
    results: dict = field(default_factory=dict)

    def send(self, cmd: str, timeout: Optional[float] = None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def recv(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise ChildFailed(f"child {self.kind} died", self.tail())
        msg = json.loads(line)
        if not msg.get("ok"):
            raise ChildFailed(f"child {self.kind} failed: {msg.get('error')}", self.tail())
        return msg.get("result", msg)

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.read().splitlines(keepends=True)[-40:])


def spawn(kind: str, args: argparse.Namespace) -> ChildProc:
    log = tempfile.TemporaryFile("w+")
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child", "--opt", kind, "--seq", str(args.seq),
        "--micro-batch", str(args.micro_batch), "--vocab", str(args.vocab), "--threads", str(args.threads),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                            env=env)
    return ChildProc(kind, proc, log)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spawn_all(args: argparse.Namespace) -> dict[str, ChildProc]:
    children = {k: spawn(k, args) for k in OPTIMIZERS}
    try:
        for c in children.values():
            c.recv()  # ready: imports done
    except ChildFailed:
        close_all(children)
        raise
    return children


def close_all(children: dict[str, ChildProc]) -> None:
    for c in children.values():
        if c.proc.poll() is None:
            try:
                c.proc.stdin.write("exit\n")
                c.proc.stdin.flush()
                c.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if c.proc.poll() is None:
            c.proc.kill()


def run_size(hidden: int, layers: int, args: argparse.Namespace, children: Optional[dict] = None) -> dict:
    """All three configurations of one size; fresh children unless ``children`` are given (reused)."""
    own = children is None
    if own:
        children = spawn_all(args)
    for c in children.values():
        c.results = {}
    try:
        for c in children.values():
            c.results["build"] = c.send(f"build {hidden} {layers}")
        log(f"hidden {hidden} x {layers} layers: models built; warm-up step (seq {min(args.seq, 64)})")
        for c in children.values():
            c.results["warmup"] = c.send("warmup")
        for k, c in children.items():
            c.results["track"] = c.send("track")
            log(f"  tracked step {k}: {c.results['track']['wall_s']:.1f} s, "
                f"peak live {c.results['track']['live_peak_bytes'] / MiB:.1f} MiB")
        order = list(OPTIMIZERS)
        steps = args.steps
        for i in range(steps):
            rot = order[i % len(order):] + order[: i % len(order)]
            for k in rot:
                children[k].results.setdefault("steps", []).append(children[k].send("step"))
            log(f"  timed round {i + 1}/{steps}: " + ", ".join(
                f"{k} {children[k].results['steps'][-1]['wall_s']:.2f} s" for k in order))
        for c in children.values():
            c.results["report"] = c.send("report")
            if not own:
                c.send("free")
    finally:
        if own:
            close_all(children)
    return {k: c.results for k, c in children.items()}


# ======================================================================== summary
def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``--sizes``: comma list of ``HIDDENxLAYERS`` (``HIDDEN`` alone means one layer), positive integers;
    ``HIDDEN`` splits into ``max(1, HIDDEN // 64)`` heads (as ``Child.cmd_build`` builds the model), which must
    divide it into an even head dimension (rotary embeddings rotate pairs)."""
    out = []
    for part in text.split(","):
        h, _, L = part.strip().partition("x")
        try:
            hidden, layers = int(h), int(L or 1)
        except ValueError:
            hidden = layers = 0
        if hidden < 1 or layers < 1:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not HIDDENxLAYERS: expected a comma list of positive integers such as 256x2,512x2,1024")
        heads = max(1, hidden // 64)
        if hidden % heads or (hidden // heads) % 2:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r}: hidden {hidden} gives {heads} attention heads (hidden // 64) of dimension "
                f"{hidden / heads:g}; the heads must divide it into an even head dimension (use a multiple of 64, "
                "or an even hidden size below 128)")
        out.append((hidden, layers))
    return out


def output_stem(name: str) -> Path:
    """The stem that ``NAME.md`` and ``NAME.json`` are written to: ``name`` with a trailing ``.md`` or ``.json``
    removed and every other dot kept (``results/run.v2`` -> ``results/run.v2.md`` and ``.json``)."""
    path = Path(name)
    for ext in (".md", ".json"):
        if path.name.endswith(ext) and len(path.name) > len(ext):
            return path.with_name(path.name[: -len(ext)])
    return path


def with_ext(stem: Path, ext: str) -> Path:
    """``stem`` + ``ext`` (``Path.with_suffix`` would replace the part after the stem's last dot)."""
    return stem.with_name(stem.name + ext)


def documented(args: argparse.Namespace) -> bool:
    """Whether the run of the parsed ``args`` is a documented one, whose tables are committed: every setting
    at the default of its mode (full or ``--quick``; unset ``--sizes``, ``--steps``, ``--reuse-processes`` are
    the mode's), with at least the mode's default number of timed steps."""
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else FULL_STEPS)
    reuse = args.reuse_processes if args.reuse_processes is not None else args.quick
    return (sizes == (QUICK_SIZES if args.quick else FULL_SIZES)
            and (args.seq, args.micro_batch, args.vocab, args.threads)
            == (DEFAULT_SEQ, DEFAULT_MICRO_BATCH, DEFAULT_VOCAB, DEFAULT_THREADS)
            and reuse == args.quick and steps >= (QUICK_STEPS if args.quick else FULL_STEPS))


def default_stem(args: argparse.Namespace) -> Path:
    """Where a run of the parsed ``args`` without ``--out`` writes: ``benchmarks/results/optimizer_memory[_quick]``
    for a :func:`documented` run, else ``runs/bench-optimizer-memory/optimizer_memory[_quick]`` under the working
    directory."""
    name = "optimizer_memory_quick" if args.quick else "optimizer_memory"
    return (COMMITTED if documented(args) else OTHER_RUNS) / name


def build_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (its child side's options hidden)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smaller sizes {QUICK_SIZES}, {QUICK_STEPS} timed steps, children reused across sizes (~1.5 min)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help=f"comma list of HIDDENxLAYERS, e.g. 256x2,512x2,1024x1 (default {FULL_SIZES}; quick {QUICK_SIZES})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps per configuration (default {FULL_STEPS}, quick {QUICK_STEPS})")
    p.add_argument("--seq", type=int, default=DEFAULT_SEQ, help=f"tokens per sequence (default {DEFAULT_SEQ})")
    p.add_argument("--micro-batch", type=int, default=DEFAULT_MICRO_BATCH,
                   help=f"sequences per micro-batch (default {DEFAULT_MICRO_BATCH})")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"vocabulary size (default {DEFAULT_VOCAB})")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"torch threads of each child (default {DEFAULT_THREADS})")
    p.add_argument("--reuse-processes", action=argparse.BooleanOptionalAction, default=None,
                   help="one child per optimizer for all sizes (saves imports; default with --quick) instead of "
                        "fresh children per size (clean peak RSS; default)")
    p.add_argument("--out", type=str, default=None,
                   help="output stem: writes STEM.md and STEM.json (a trailing .md/.json is dropped; default: "
                        "benchmarks/results/optimizer_memory[_quick] for the documented full or --quick run, any "
                        f"other run {OTHER_RUNS}/optimizer_memory[_quick])")
    # child side
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--opt", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    p.add_argument("--render", type=str, default=None, metavar="JSON",
                   help="do not run: re-print a saved results JSON and write its markdown beside it "
                        "(X.json -> X.md; the JSON is left as it is)")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.child:
        child_main(args)
        return
    for flag in ("steps", "seq", "micro_batch", "vocab", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"argument --{flag.replace('_', '-')}: must be a positive integer, got {getattr(args, flag)}")
    if args.render:
        path = Path(args.render)
        try:
            text = path.read_text()
        except OSError as exc:
            p.error(f"argument --render: cannot read {path}: {exc.strerror or exc}")
        except UnicodeDecodeError as exc:
            p.error(f"argument --render: {path} is not a results JSON of this benchmark (not UTF-8 text: {exc.reason})")
        try:
            saved = json.loads(text)
            rows, meta = saved["rows"], saved["meta"]
        except (ValueError, KeyError, TypeError) as exc:
            p.error(f"argument --render: {path} is not a results JSON of this benchmark "
                    f"(an object with 'rows' and 'meta'): {type(exc).__name__}: {exc}")
        try:
            for r in rows:
                r["verdicts"] = verdicts(r)
            meta["notes"] = NOTES
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            p.error(f"argument --render: {path} is not a results JSON of this benchmark "
                    f"(its rows lack the measured numbers): {type(exc).__name__}: {exc}")
        md = with_ext(output_stem(str(path)), ".md")
        refuse_unwritable(p, "--render", md)
        emit(rows, meta, output_stem(str(path)), write_json=False)
        return

    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else FULL_STEPS
    if args.reuse_processes is None:
        args.reuse_processes = args.quick
    out_stem = output_stem(args.out) if args.out else default_stem(args)
    refuse_unwritable(p, "--out", with_ext(out_stem, ".md"), with_ext(out_stem, ".json"))
    t0 = time.time()
    load_start = os.getloadavg()
    raw = {}
    shared = None
    try:
        shared = spawn_all(args) if args.reuse_processes else None
        for hidden, layers in sizes:
            raw[(hidden, layers)] = run_size(hidden, layers, args, shared)
    except ChildFailed as exc:
        raise SystemExit(f"{Path(__file__).name}: error: {exc} (its log: {exc.save_log()})") from None
    finally:
        if shared is not None:
            close_all(shared)
    runtime = time.time() - t0
    rows = summarize(raw)

    import torch

    meta = {
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runtime_s": runtime,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "vocab": args.vocab,
        "steps": args.steps,
        "reuse_processes": args.reuse_processes,
        "sizes": sizes,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "notes": NOTES,
    }
    emit(rows, meta, out_stem)


def emit(rows: list[dict], meta: dict, out_stem: Path, *, write_json: bool = True) -> None:
    """Print the table, verdicts and details; write ``OUT_STEM.md`` and (``write_json``) ``OUT_STEM.json``."""
    print()
    print_table(rows)
    print()
    for line in verdict_lines(rows):
        print(line)
    print()
    for line in detail_lines(rows):
        print(line)
    print(f"\nruntime {meta['runtime_s']:.0f} s (load average at start {meta['load_avg_start'][0]:.1f}, "
          f"at end {meta['load_avg_end'][0]:.1f})")

    out_stem.parent.mkdir(parents=True, exist_ok=True)
    md = with_ext(out_stem, ".md")
    md.write_text(markdown(rows, meta))
    if not write_json:
        print(f"wrote {md}")
        return
    js = with_ext(out_stem, ".json")
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
